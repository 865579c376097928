"""Embedded models: small targets and drafts built locally, so the defaults need no download.

    target.model: embedded:code-deep         # 20-layer Llama, pretrained on the stdlib sources
    draft.model: embedded:code-deep-draft    # 1-layer Llama, pretrained on the same corpus

The default pair (recipes/code.yaml) is "code-deep" / "code-deep-draft": the draft costs
a small fraction of a target decoding step on a CPU, so speculative decoding pays off as it
does for real pairs. "code" / "code-draft" (4 layers / 1 layer, where the draft costs a
larger fraction of a step) is the pair that the studies of docs/quality.md, docs/eagle3.md,
docs/drift.md, docs/online.md and docs/cache.md ran on (their numbers are in
benchmarks/RESULTS.md, each section naming its pair); "prose" / "prose-draft" is a pair
whose target never saw code; "tiny" / "tiny-draft" builds in seconds for the tests.

`resolve_model("embedded:code-deep")` builds the model on first use (its build time on a
machine is in benchmarks/RESULTS.md; the build shows its progress with an ETA measured as it
goes, specdistill/progress.py), caches it as an ordinary Hugging Face model directory under
`<cache>/embedded/code-deep/` and returns that path, which then goes through the same
`from_pretrained` calls as a hub model. The cache root is `$SPECDISTILL_CACHE` or
`~/.cache/specdistill`. Build by hand with

    python -c "from specdistill.models.embedded import resolve_model as r; r('embedded:code-deep')"

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

Modules: models/embedded_specs.py names and specifies the models, models/embedded_train.py
trains a tokenizer and a model; this one resolves names, caches, locks and publishes builds.
"""

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from specdistill.errors import UserError
from specdistill.models.embedded_specs import (
    BUILD_RECORD,
    BUILD_VERSION,
    CHAT_TEMPLATE,
    CODE,
    EMBEDDED,
    EOS,
    PREFIX,
    PROSE,
    SPECIAL_TOKENS,
    TINY,
    CorpusSpec,
    EmbeddedSpec,
    record_spec,
    same_spec,
)
from specdistill.models.embedded_train import log, new_tokenizer, train_model
from specdistill.publish import publish_dir, waiting_lock
from specdistill.threads import ThreadPolicy

__all__ = [
    "BUILD_RECORD",
    "BUILD_VERSION",
    "CHAT_TEMPLATE",
    "CODE",
    "EMBEDDED",
    "EOS",
    "PREFIX",
    "PROSE",
    "SPECIAL_TOKENS",
    "TINY",
    "CorpusSpec",
    "EmbeddedSpec",
    "build",
    "cache_root",
    "record_spec",
    "resolve_model",
]


def cache_root() -> Path:
    """`$SPECDISTILL_CACHE`, else `~/.cache/specdistill`."""
    return Path(os.environ.get("SPECDISTILL_CACHE") or "~/.cache/specdistill").expanduser()


def resolve_model(name_or_path: str) -> str:
    """`"embedded:<name>"` -> path of the built model dir (built if missing); else unchanged."""
    if not name_or_path.startswith(PREFIX):
        return name_or_path
    name = name_or_path.removeprefix(PREFIX)
    path = model_dir(name)  # validates the name
    if _is_current(path, EMBEDDED[name]):
        return str(path)
    return str(build(name))


def build(name: str, *, force: bool = False) -> Path:
    """Build embedded model `name` into `<cache>/embedded/<name>/` unless already current.

    Blocks while another process builds; `force` rebuilds the model (not its tokenizer).
    """
    final = model_dir(name)
    spec = EMBEDDED[name]
    with waiting_lock(_embedded_root(), log):  # held for the whole build
        if not force and _is_current(final, spec):
            return final
        _remove_leftovers()
        tokenizer_dir = _ensure_tokenizer(spec.corpus)
        tmp = _new_tmp_dir(name)
        try:
            with _thread_policy(spec.threads) as threads:
                _train_model(name, spec, tokenizer_dir, tmp, threads)
            publish_dir(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def model_dir(name: str) -> Path:
    """The directory the embedded model `name` is built in (built or not); a UserError naming
    the valid names for an unknown one."""
    if name not in EMBEDDED:
        valid = ", ".join(PREFIX + n for n in EMBEDDED)
        raise UserError(f"unknown embedded model {PREFIX + name!r}; valid names: {valid}")
    return _embedded_root() / name


def _embedded_root() -> Path:
    return cache_root() / "embedded"


@contextlib.contextmanager
def _thread_policy(forced: int | None) -> Iterator[ThreadPolicy]:
    """The build's torch intra-op threads (specdistill/threads.py): the spec's count when it
    sets one, else the free cores, re-checked between steps; torch's count restored after."""
    previous = torch.get_num_threads()
    policy = ThreadPolicy(forced, name="EmbeddedSpec.threads", say=log)
    policy.start()
    try:
        yield policy
    finally:
        torch.set_num_threads(previous)


# --- cache: lock, records, atomic publish ------------------------------------------------


def _is_current(path: Path, spec: EmbeddedSpec | CorpusSpec) -> bool:
    """True when `path` holds a complete build of `spec` by this BUILD_VERSION."""
    try:
        record = json.loads((path / BUILD_RECORD).read_text())
    except (OSError, ValueError):
        return False
    return record.get("build_version") == BUILD_VERSION and same_spec(record.get("spec"), spec)


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
        log(f"removing leftover of an interrupted build: {path}")
        shutil.rmtree(path, ignore_errors=True)


def _write_record(path: Path, spec: EmbeddedSpec | CorpusSpec, **fields) -> None:
    record = {"build_version": BUILD_VERSION, "spec": record_spec(spec), **fields}
    (path / BUILD_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def _ensure_tokenizer(corpus: CorpusSpec) -> Path:
    """Path of the family's tokenizer, training it first if needed. Caller holds the lock."""
    final = _embedded_root() / "tokenizers" / corpus.name
    if _is_current(final, corpus):
        return final
    log(f"training the {corpus.vocab_size}-token byte-level BPE tokenizer '{corpus.name}'")
    start = time.perf_counter()
    wrapped = new_tokenizer(corpus)
    tmp = _new_tmp_dir(f"tokenizer-{corpus.name}")
    try:
        wrapped.save_pretrained(tmp)
        _write_record(tmp, corpus, wall_time_s=round(time.perf_counter() - start, 1))
        publish_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _train_model(
    name: str, spec: EmbeddedSpec, tokenizer_dir: Path, out: Path, threads: ThreadPolicy
) -> None:
    """Pretrain `spec` from scratch and save model, tokenizer and build record into `out`."""
    _write_record(out, spec, **train_model(name, spec, tokenizer_dir, out, threads))
