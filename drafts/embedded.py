"""Embedded models: small targets and drafts built locally, so the defaults need no download.

    target.model: embedded:code-deep         # 20-layer Llama, pretrained on the stdlib sources
    draft.model: embedded:code-deep-draft    # 1-layer Llama, pretrained on the same corpus

The default pair (recipes/code.yaml) is "code-deep" / "code-deep-draft": the draft costs
about 0.15 of a target decoding step on a CPU, so speculative decoding pays off as it does
for real pairs. "code" / "code-draft" (4 layers / 1 layer, where the draft costs ~0.4 of a
step) is the pair that the studies of docs/quality.md, docs/eagle3.md, docs/drift.md,
docs/online.md and docs/cache.md ran on; "prose" / "prose-draft" is a pair whose target
never saw code; "tiny" / "tiny-draft" builds in seconds for the tests.

`resolve_model("embedded:code-deep")` builds the model on first use (a few minutes on 2
CPU cores), caches it as an ordinary Hugging Face model directory under
`<cache>/embedded/code-deep/` and returns that path, which then goes through the same
`from_pretrained` calls as a hub model. The cache root is `$SPECDISTILL_CACHE` or
`~/.cache/specdistill`. Build by hand with

    python -c "from specdistill.drafts.embedded import resolve_model as r; r('embedded:code-deep')"

The corpus is the running interpreter's standard library (`data.stdlib`): the tokenizer
and models train on the "train" split and report next-token loss on the "heldout" split.
A model family ("code", "prose", "tiny") shares one byte-level BPE tokenizer, built once and
copied into every model directory of the family, so target and draft ids agree.

Builds are deterministic (fixed seed, sorted files, fixed step counts) and safe to run
from several processes at once (`accelerate launch`): one process holds an `flock` on
`<cache>/embedded/.lock` and builds, the others wait and then load its result. A build
writes into a temporary directory next to the cache and is renamed into place only once
complete, so an interrupted build never leaves a directory at the final path; leftovers
are removed by the next build.
"""

import contextlib
import fcntl
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from specdistill.data.stdlib import stdlib_files, stdlib_prose
from specdistill.drafts.model_lock import model_lock
from specdistill.publish import publish_dir

# Bump when a change to this file changes what a build produces: cached builds with
# another version are rebuilt.
BUILD_VERSION = 1
BUILD_RECORD = "specdistill_build.json"
PREFIX = "embedded:"

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class CorpusSpec:
    """The tokenizer and text of a model family; models of one family share its tokenizer."""

    name: str
    vocab_size: int
    train_files: int | None = None  # None: the whole train split; n: n files spread over it
    heldout_files: int | None = None
    text: str = "code"  # code: the stdlib sources; prose: their docstrings and help topics


@dataclass(frozen=True)
class EmbeddedSpec:
    """A Llama model pretrained from scratch with next-token loss on `corpus`."""

    corpus: CorpusSpec
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    seq_len: int  # training block length (packed documents separated by EOS)
    batch_size: int
    steps: int
    lr: float
    warmup_steps: int
    eval_blocks: int  # held-out blocks of `seq_len` scored for the build record
    eta: str  # shown while building
    seed: int = 0
    threads: int | None = None  # torch intra-op threads while building; None: torch's default
    # Progressive stacking (Gong et al. 2019, "Efficient Training of BERT by Progressively
    # Stacking"): train `grow_from_layers` layers for the first `grow_at_step` steps, then
    # repeat each layer num_layers / grow_from_layers times and train the rest at full depth.
    # A deep narrow target costs many layers per decoding step (what makes a draft cheap
    # next to it) but trains slowly from scratch; the shallow model learns fast and the
    # grown one starts from what it learnt. None: one stage at full depth.
    grow_from_layers: int | None = None
    grow_at_step: int = 0

    def __post_init__(self):
        if self.grow_from_layers is not None:
            if self.num_layers % self.grow_from_layers:
                raise ValueError(
                    f"num_layers {self.num_layers} is not a multiple of grow_from_layers "
                    f"{self.grow_from_layers}"
                )
            if not 0 < self.grow_at_step < self.steps:
                raise ValueError(f"grow_at_step must be in (0, steps={self.steps})")


CODE = CorpusSpec("code", vocab_size=4096)
PROSE = CorpusSpec("prose", vocab_size=2048, text="prose")
TINY = CorpusSpec("tiny", vocab_size=512, train_files=12, heldout_files=3)

EMBEDDED: dict[str, EmbeddedSpec] = {
    # Sizes and steps measured on 2 CPU cores, where building both takes about 4 minutes.
    # With so little compute, optimizer steps matter more than width: a 192-wide model on
    # batches of 4 reaches a lower held-out loss in the same time than a 256-wide one on 8.
    "code": EmbeddedSpec(
        CODE,
        hidden_size=192,
        num_layers=4,
        num_heads=4,
        intermediate_size=512,
        max_position_embeddings=1024,
        seq_len=512,
        batch_size=4,
        steps=450,
        lr=3e-3,
        warmup_steps=20,
        eval_blocks=48,
        eta="~3.5 min on 2 CPU cores",
    ),
    "code-draft": EmbeddedSpec(
        CODE,
        hidden_size=128,
        num_layers=1,
        num_heads=2,
        intermediate_size=344,
        max_position_embeddings=1024,
        seq_len=512,
        batch_size=4,
        steps=120,
        lr=3e-3,
        warmup_steps=8,
        eval_blocks=48,
        eta="~30 s on 2 CPU cores",
    ),
    # The default pair (recipes/code.yaml): a target deep enough that the one-layer draft
    # costs ~0.15 of its decoding step on a CPU, as drafts do next to real targets on GPUs
    # (per-layer overhead, not width, sets a small model's decoding step on a CPU). Measured
    # on 2 CPU cores: 20 layers grown from 4 (progressive stacking) reach 5.30 nats held out
    # in 280 s (16 grown from 4: 5.29 in 257 s); trained from scratch, 16 layers reached 6.36
    # in 277 s (300 steps of 8 x 256) and 20 layers 6.60 in 332 s (240 steps of 4 x 512);
    # "code" has 5.80.
    "code-deep": EmbeddedSpec(
        CODE,
        hidden_size=128,
        num_layers=20,
        num_heads=4,
        intermediate_size=344,
        max_position_embeddings=1024,
        seq_len=256,
        batch_size=8,
        steps=600,
        lr=3e-3,
        warmup_steps=20,
        eval_blocks=96,
        eta="~4.5 min on 2 CPU cores",
        grow_from_layers=4,
        grow_at_step=450,
    ),
    "code-deep-draft": EmbeddedSpec(
        CODE,
        hidden_size=128,
        num_layers=1,
        num_heads=2,
        intermediate_size=344,
        max_position_embeddings=1024,
        seq_len=256,
        batch_size=8,
        steps=400,
        lr=3e-3,
        warmup_steps=8,
        eval_blocks=96,
        eta="~1 min on 2 CPU cores",
    ),
    # A second pair whose target never saw code: English documentation (data.stdlib_prose),
    # for comparisons that must not hold only on code (docs/quality.md). ~1.5 min to build.
    "prose": EmbeddedSpec(
        PROSE,
        hidden_size=160,
        num_layers=3,
        num_heads=4,
        intermediate_size=432,
        max_position_embeddings=512,
        seq_len=256,
        batch_size=8,
        steps=400,
        lr=3e-3,
        warmup_steps=20,
        eval_blocks=48,
        eta="~1.5 min on 2 CPU cores",
    ),
    "prose-draft": EmbeddedSpec(
        PROSE,
        hidden_size=96,
        num_layers=1,
        num_heads=2,
        intermediate_size=256,
        max_position_embeddings=512,
        seq_len=256,
        batch_size=8,
        steps=100,
        lr=3e-3,
        warmup_steps=8,
        eval_blocks=48,
        eta="~15 s on 2 CPU cores",
    ),
    # A micro pair for tests: builds in seconds.
    "tiny": EmbeddedSpec(
        TINY,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        seq_len=64,
        batch_size=8,
        steps=20,
        lr=3e-3,
        warmup_steps=2,
        eval_blocks=8,
        eta="seconds",
        threads=1,  # ops this small only pay for splitting across threads
    ),
    "tiny-draft": EmbeddedSpec(
        TINY,
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        intermediate_size=32,
        max_position_embeddings=128,
        seq_len=64,
        batch_size=8,
        steps=10,
        lr=3e-3,
        warmup_steps=1,
        eval_blocks=8,
        eta="seconds",
        threads=1,  # ops this small only pay for splitting across threads
    ),
}


def cache_root() -> Path:
    """`$SPECDISTILL_CACHE`, else `~/.cache/specdistill`."""
    return Path(os.environ.get("SPECDISTILL_CACHE") or "~/.cache/specdistill").expanduser()


def resolve_model(name_or_path: str) -> str:
    """`"embedded:<name>"` -> path of the built model dir (built if missing); else unchanged."""
    if not name_or_path.startswith(PREFIX):
        return name_or_path
    name = name_or_path.removeprefix(PREFIX)
    path = _model_dir(name)  # validates the name
    if _is_current(path, _record_spec(EMBEDDED[name])):
        return str(path)
    return str(build(name))


def build(name: str, *, force: bool = False) -> Path:
    """Build embedded model `name` into `<cache>/embedded/<name>/` unless already current.

    Blocks while another process builds; `force` rebuilds the model (not its tokenizer).
    """
    final = _model_dir(name)
    spec = EMBEDDED[name]
    with _build_lock():
        if not force and _is_current(final, _record_spec(spec)):
            return final
        _remove_leftovers()
        tokenizer_dir = _ensure_tokenizer(spec.corpus)
        tmp = _new_tmp_dir(name)
        try:
            with _num_threads(spec.threads):
                _train_model(name, spec, tokenizer_dir, tmp)
            publish_dir(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _model_dir(name: str) -> Path:
    if name not in EMBEDDED:
        valid = ", ".join(PREFIX + n for n in EMBEDDED)
        raise ValueError(f"unknown embedded model {PREFIX + name!r}; valid names: {valid}")
    return _embedded_root() / name


def _embedded_root() -> Path:
    return cache_root() / "embedded"


@contextlib.contextmanager
def _num_threads(threads: int | None) -> Iterator[None]:
    """Run with `threads` torch intra-op threads (unchanged when None), then restore."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _log(message: str) -> None:
    print(f"[specdistill embedded] {message}", file=sys.stderr, flush=True)


# --- cache: lock, records, atomic publish ------------------------------------------------


@contextlib.contextmanager
def _build_lock() -> Iterator[None]:
    """Exclusive `flock` on `<cache>/embedded/.lock`, held for a whole build.

    The lock file is never deleted (deleting it would let two processes lock different
    files). The kernel releases the lock when its holder dies, so a killed build never
    blocks the next one.
    """
    root = _embedded_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for another process to finish building (lock {root / '.lock'})")
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


# Fields added after builds were cached, left out of a record at these defaults so that the
# builds made before them stay current.
_LATER_FIELDS = {"text": "code", "grow_from_layers": None, "grow_at_step": 0}


def _record_spec(spec: EmbeddedSpec | CorpusSpec) -> dict:
    """The spec as it reads back from a build record (JSON round trip), without the fields
    of `_LATER_FIELDS` at their defaults."""
    record = json.loads(json.dumps(asdict(spec)))
    for part in (record, record.get("corpus", {})):
        for key, default in _LATER_FIELDS.items():
            if key in part and part[key] == default:
                del part[key]
    return record


def _is_current(path: Path, spec: dict) -> bool:
    """True when `path` holds a complete build of `spec` by this BUILD_VERSION."""
    try:
        record = json.loads((path / BUILD_RECORD).read_text())
    except (OSError, ValueError):
        return False
    return record.get("build_version") == BUILD_VERSION and record.get("spec") == spec


def _new_tmp_dir(name: str) -> Path:
    """A build directory beside the cache, moved into place by `publish_dir` when complete."""
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=_embedded_root()))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is as readable as any model dir
    return tmp


def _remove_leftovers() -> None:
    """Delete temp dirs of killed builds. Only called while holding the build lock, when no
    other build can be running, so every temp dir is stale. A replaced build is moved aside
    beside its final path (`publish_dir`): tokenizers' into `tokenizers/`."""
    root = _embedded_root()
    stale = [*root.glob(".tmp-*"), *root.glob(".old-*"), *root.glob("tokenizers/.old-*")]
    for path in sorted(stale):
        _log(f"removing leftover of an interrupted build: {path}")
        shutil.rmtree(path, ignore_errors=True)


def _write_record(path: Path, spec: EmbeddedSpec | CorpusSpec, **fields) -> None:
    record = {"build_version": BUILD_VERSION, "spec": _record_spec(spec), **fields}
    (path / BUILD_RECORD).write_text(json.dumps(record, indent=2) + "\n")


# --- corpus and tokenizer ----------------------------------------------------------------


def _spread(files: list[Path], n: int | None) -> list[Path]:
    """`n` files evenly spread over the sorted list (all of them when `n` is None)."""
    if n is None or n >= len(files):
        return files
    return [files[i * len(files) // n] for i in range(n)]


def _corpus_texts(corpus: CorpusSpec, split: str) -> list[str]:
    n = corpus.train_files if split == "train" else corpus.heldout_files
    if corpus.text == "prose":
        return list(_spread(list(stdlib_prose(split)), n))
    files = _spread(stdlib_files(split), n)
    return [path.read_text(encoding="utf-8", errors="replace") for path in files]


def _ensure_tokenizer(corpus: CorpusSpec) -> Path:
    """Path of the family's tokenizer, training it first if needed. Caller holds the lock."""
    final = _embedded_root() / "tokenizers" / corpus.name
    if _is_current(final, _record_spec(corpus)):
        return final
    _log(f"training the {corpus.vocab_size}-token byte-level BPE tokenizer '{corpus.name}'")
    start = time.perf_counter()
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=corpus.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_texts(corpus, "train"), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    tmp = _new_tmp_dir(f"tokenizer-{corpus.name}")
    try:
        wrapped.save_pretrained(tmp)
        _write_record(tmp, corpus, wall_time_s=round(time.perf_counter() - start, 1))
        publish_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _token_stream(tokenizer: tokenizers.Tokenizer, texts: list[str], eos_id: int) -> torch.Tensor:
    """All documents as one id stream, each followed by EOS: [n_tokens] int64."""
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    return torch.cat([torch.tensor([*e.ids, eos_id]) for e in encodings])


def _blocks(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut the stream into non-overlapping blocks: [n_blocks, seq_len]."""
    n_blocks = len(stream) // seq_len
    return stream[: n_blocks * seq_len].view(n_blocks, seq_len)


# --- model -------------------------------------------------------------------------------


def _train_step(model, optimizer, scheduler, input_ids: torch.Tensor) -> float:
    """One next-token-loss step on `input_ids: [batch, seq]`; returns the loss."""
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


@torch.no_grad()
def _eval_loss(model, blocks: torch.Tensor, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats) over `blocks: [n, seq]`."""
    model.eval()
    total, count = 0.0, 0
    for batch in blocks.split(batch_size):
        logits = model(input_ids=batch).logits[:, :-1].float()
        total += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        count += batch[:, 1:].numel()
    model.train()
    return float(total) / count


def _unigram_loss(train: torch.Tensor, blocks: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy of the add-one unigram distribution of `train` on the targets of `blocks`."""
    counts = torch.bincount(train, minlength=vocab_size).double() + 1
    log_probs = (counts / counts.sum()).log()
    return float(-log_probs[blocks[:, 1:]].mean())


def _lr_lambda(spec: EmbeddedSpec):
    """Linear warmup, then cosine decay to 10% of the peak."""

    def factor(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _optimizer(model, spec: EmbeddedSpec, first_step: int):
    """AdamW (weight decay on matrices only) and the spec's schedule from `first_step` on."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.95),
    )
    factor = _lr_lambda(spec)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: factor(first_step + s))


def _grown(model, config: LlamaConfig):
    """A `config.num_hidden_layers`-layer copy of `model` with each layer repeated k times.

    Every copy's residual outputs (o_proj, down_proj) are divided by k: k copies of a layer
    that each add f(x) / k add about f(x), so the deep model starts near the shallow one.
    """
    shallow = model.state_dict()
    k = config.num_hidden_layers // model.config.num_hidden_layers
    with torch.random.fork_rng(devices=[]), model_lock():
        deep = LlamaForCausalLM(config)  # every weight is overwritten below
    state = {}  # load_state_dict copies every tensor into the deep model's own parameters
    for key in deep.state_dict():
        if ".layers." not in key:
            state[key] = shallow[key]
            continue
        head, rest = key.split(".layers.")
        index, tail = rest.split(".", 1)
        weight = shallow[f"{head}.layers.{int(index) // k}.{tail}"]
        if tail in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            weight = weight / k
        state[key] = weight
    deep.load_state_dict(state)
    deep.tie_weights()
    return deep


def _train_model(name: str, spec: EmbeddedSpec, tokenizer_dir: Path, out: Path) -> None:
    """Pretrain `spec` from scratch and save model, tokenizer and build record into `out`."""
    start = time.perf_counter()
    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS)
    vocab_size = tokenizer.get_vocab_size()
    train = _token_stream(tokenizer, _corpus_texts(spec.corpus, "train"), eos_id)
    heldout = _token_stream(tokenizer, _corpus_texts(spec.corpus, "heldout"), eos_id)
    train_blocks = _blocks(train, spec.seq_len)
    heldout_blocks = _blocks(heldout, spec.seq_len)
    pick = torch.linspace(0, len(heldout_blocks) - 1, min(spec.eval_blocks, len(heldout_blocks)))
    eval_blocks = heldout_blocks[pick.long()]

    def config(num_layers: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_heads,
            max_position_embeddings=spec.max_position_embeddings,
            tie_word_embeddings=True,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
        )

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        with model_lock():
            model = LlamaForCausalLM(config(spec.grow_from_layers or spec.num_layers))
    stages = ""
    if spec.grow_from_layers:
        stages = f" (the first {spec.grow_at_step} at {spec.grow_from_layers} layers)"
    _log(
        f"building '{name}' (once, {spec.eta}): {spec.num_layers}-layer Llama, "
        f"{spec.steps} steps x {spec.batch_size}x{spec.seq_len} tokens{stages} "
        f"from {len(train):,} training tokens"
    )
    optimizer, scheduler = _optimizer(model, spec, 0)
    generator = torch.Generator().manual_seed(spec.seed)
    order = torch.randperm(len(train_blocks), generator=generator)
    cursor = 0
    log_every = max(1, spec.steps // 8)
    model.train()
    for step in range(spec.steps):
        if spec.grow_from_layers and step == spec.grow_at_step:
            model = _grown(model, config(spec.num_layers))
            model.train()
            optimizer, scheduler = _optimizer(model, spec, step)
            _log(f"'{name}' step {step}: grown to {spec.num_layers} layers")
        if cursor + spec.batch_size > len(order):
            order, cursor = torch.randperm(len(train_blocks), generator=generator), 0
        batch = train_blocks[order[cursor : cursor + spec.batch_size]]
        cursor += spec.batch_size
        loss = _train_step(model, optimizer, scheduler, batch)
        if (step + 1) % log_every == 0 or step + 1 == spec.steps:
            elapsed = time.perf_counter() - start
            _log(f"'{name}' step {step + 1}/{spec.steps}  loss {loss:.3f}  ({elapsed:.0f}s)")

    n_params = sum(p.numel() for p in model.parameters())
    heldout_loss = _eval_loss(model, eval_blocks, spec.batch_size)
    unigram_loss = _unigram_loss(train, eval_blocks, vocab_size)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False
    )
    model.save_pretrained(out)
    for file in tokenizer_dir.iterdir():
        if file.name != BUILD_RECORD:
            shutil.copy2(file, out / file.name)
    wall = time.perf_counter() - start
    _write_record(
        out,
        spec,
        name=name,
        seed=spec.seed,
        python=sys.version.split()[0],
        torch=torch.__version__,
        transformers=transformers.__version__,
        n_params=n_params,
        train_steps=spec.steps,
        train_tokens=spec.steps * spec.batch_size * spec.seq_len,
        heldout_loss=round(heldout_loss, 4),
        heldout_unigram_loss=round(unigram_loss, 4),
        heldout_eval_tokens=eval_blocks[:, 1:].numel(),
        wall_time_s=round(wall, 1),
    )
    _log(
        f"built '{name}' in {wall:.0f}s: held-out loss {heldout_loss:.3f} "
        f"(perplexity {math.exp(heldout_loss):.1f}; unigram {unigram_loss:.3f})"
    )
