"""What answers a regenerate or prepare run: the project's engine over the loaded target, or
vLLM's offline engine (eval/vllm_engine.py) over the same model files. It loads torch and
transformers: `regenerate` imports it once its arguments are parsed.

Both are handed to `regenerate`'s answering as an `AnswerEngine`: the model given to
`generate` (whose signature is `eval.engine.generate`'s), the columns compared, the target's
identity, and what the manifest records of the engine (`answered_in`: the engine's name and
the dtype it answered in; a rerun that would answer otherwise into the same directory is
refused, since the shards would mix two distributions). vLLM answers without the torch target
ever loading, so on a GPU the two never share its memory.
"""

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from transformers import AutoConfig

from specdistill.eval import engine
from specdistill.eval.vllm_engine import VllmEngine, VllmSettings
from specdistill.eval.vllm_features import VllmFeatures
from specdistill.models import hub
from specdistill.models.target_spec import (
    TargetSpec,
    load_target_and_tokenizer,
    load_tokenizer,
    with_pad_token,
)
from specdistill.train.regenerate_sampling import RegenerateError
from specdistill.train.target_cache import target_identity

__all__ = [
    "AnswerEngine",
    "build",
    "project_engine",
    "resolve",
    "torch_target",
    "vllm_engine",
    "vllm_hidden_states",
]

PROJECT = "specdistill"
VLLM = "vllm"
AUTO = "auto"


def resolve(name: str) -> str:
    """`prepare.engine`'s engine: "auto" is vLLM where it is installed, else the project's."""
    if name == AUTO:
        return VLLM if importlib.util.find_spec("vllm") is not None else PROJECT
    if name not in (PROJECT, VLLM):
        raise RegenerateError(f"engine must be {PROJECT}, {VLLM} or {AUTO}, got {name!r}")
    return name


@dataclass
class AnswerEngine:
    """One run's answering engine (see the module's docstring)."""

    model: object  # the first argument of `generate`
    generate: Callable
    tokenizer: object
    vocab_size: int  # the logit columns compared (`hub.shared_vocab_size`)
    identity: dict  # `train.target_cache.target_identity`
    answered_in: dict  # {"engine": PROJECT | VLLM, "dtype": ...}
    description: str
    close: Callable[[], None] = lambda: None
    concurrency: int | None = None  # answers decoded together, where the engine sets it


def build(
    r,
    engine: str,
    *,
    target,
    tokenizer,
    generate: Callable | None,
    start_threads: Callable[[], object],
    batch_size: int,
    top_n: int | None,
) -> AnswerEngine:
    """The engine `engine` names ("auto": `resolve`'s) for the recipe `r`: vLLM over the
    target's files, or the project's over `target` (loaded unless given)."""
    if resolve(engine) == VLLM:
        return vllm_engine(r, tokenizer, batch_size=batch_size, top_n=top_n)
    return project_engine(r, target, tokenizer, generate, start_threads)


def project_engine(r, target, tokenizer, generate: Callable | None, start_threads) -> AnswerEngine:
    """The project's engine (`generate`, default `eval.engine.generate`) over the recipe's
    target, loaded unless given; a loaded target moves to the GPU when there is one.
    `start_threads`: called once a target was loaded here (the recipe's thread count)."""

    if target is None:
        target, tokenizer = torch_target(r, tokenizer, start_threads)
    else:
        target, tokenizer = load_target_and_tokenizer(
            TargetSpec.from_recipe(r.target), target=target, tokenizer=tokenizer
        )
    return AnswerEngine(
        model=target,
        generate=generate or engine.generate,
        tokenizer=tokenizer,
        vocab_size=hub.shared_vocab_size(target, None, tokenizer),
        identity=target_identity(r.target, target),
        answered_in={"engine": PROJECT, "dtype": r.target.dtype},
        description="specdistill.eval.engine.generate (target only)",
    )


def torch_target(r, tokenizer, start_threads: Callable[[], object]) -> tuple:
    """(the recipe's target loaded in torch, its tokenizer, loaded unless given); once the
    target loads `start_threads` is called (the recipe's thread count), then the target moves
    to the GPU when there is one."""
    target, tokenizer = load_target_and_tokenizer(
        TargetSpec.from_recipe(r.target), tokenizer=tokenizer
    )
    start_threads()
    if hasattr(target, "to"):
        target = target.to("cuda" if torch.cuda.is_available() else "cpu")
    return target, tokenizer


def vllm_engine(r, tokenizer, *, batch_size: int, top_n: int | None) -> AnswerEngine:
    """vLLM over the recipe's target files (`prepare.vllm`'s settings); the torch target is
    not loaded. RegenerateError for a target vLLM cannot take as it stands (an adapter)."""
    t = r.target
    path, settings = _vllm_target(r, batch_size)
    spec = TargetSpec.from_recipe(t)
    tokenizer = load_tokenizer(spec) if tokenizer is None else with_pad_token(tokenizer)
    config = AutoConfig.from_pretrained(path, revision=t.revision)
    shell = SimpleNamespace(config=config)  # the identity of a hub id hashes its config
    vocab_size = len(tokenizer)
    rows = getattr(config, "vocab_size", vocab_size)
    if rows < vocab_size:
        raise RegenerateError(
            f"{t.model}: the output head has {rows} rows but the tokenizer has {vocab_size} tokens"
        )
    vllm = VllmEngine(path, settings, max_logprobs=top_n or 0)
    return AnswerEngine(
        model=vllm,
        generate=_vllm_generate,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        identity=target_identity(t, shell),
        answered_in={"engine": VLLM, "dtype": settings.dtype},
        description=vllm.description,
        close=vllm.close,
        concurrency=settings.max_num_seqs,
    )


def _vllm_target(r, batch_size: int) -> tuple[str, VllmSettings]:
    """(the recipe's target files or hub id, vLLM's settings from `prepare.vllm`);
    RegenerateError for a target vLLM cannot take as it stands (an adapter)."""
    t, v = r.target, r.prepare.vllm
    if t.adapter:
        raise RegenerateError(
            f"prepare.engine vllm answers with the base model alone, and target.adapter is "
            f"{t.adapter}: merge the adapter into a model directory and name it in "
            "target.model, or answer with prepare.engine specdistill"
        )
    settings = VllmSettings(
        dtype=v.dtype or t.dtype,
        compile=v.compile,
        kv_cache_gib=v.kv_cache_gib,
        max_num_seqs=v.max_num_seqs or batch_size,
        threads=r.train.threads,
        seed=r.prepare.seed,
    )
    return hub.local_model_dir(t.model) or t.model, settings  # embedded, registry: built


def vllm_hidden_states(r, batch_size: int) -> Callable[[list[int]], VllmFeatures]:
    """What starts vLLM over the recipe's target (`prepare.vllm`'s settings) for the hidden
    states entering the layers it is given (`target_cache_build.HiddenStates`)."""
    path, settings = _vllm_target(r, batch_size)
    return lambda layers: VllmFeatures(path, layers, settings)


def _vllm_generate(engine, draft, prompts, *, batch_size=None, **sampling):
    """`eval.engine.generate`'s call, answered by a `VllmEngine` (the target alone: `draft`
    is None; vLLM's own `max_num_seqs` stands for `batch_size`)."""
    if draft is not None:
        raise ValueError("the vLLM answering engine decodes with the target alone")
    return engine.generate(prompts, **sampling)
