"""Export a trained draft for an inference engine: vLLM, SGLang or a Hugging Face directory.

    specdistill export --draft runs/code/final --format vllm --out exports/code-vllm
    specdistill export --draft runs/eagle/final --format sglang --out exports/eagle-sgl \\
        --verifier Qwen/Qwen2.5-Coder-7B-Instruct [--speculative-tokens N] [--overwrite]
    specdistill export --draft my-draft --format vllm --out exports/d --tokenizer TARGET_DIR

(`python -m specdistill.train.export ...` is the same command; train/export_cli.py parses
it.) The draft's type is detected by the drafts layer (`drafts.detect`: an EAGLE-3 head in
the speculators or SGLang layout, else a Hugging Face causal LM), which declares its export
formats and how it is written (`capabilities.formats`, `capabilities.export_as`) and
contributes, from its own subpackage, its writer per format, its reader per layout and its
serve hint per format (its `exports`: drafts/export.py describes the interface;
docs/theory.md §5 the layouts). The formats and their tables, assembled from the registered
types: formats.py. This package is the verb around them:

  __init__.py  the checks before writing, the tokenizer files, the write beside --out, the
               re-read, the serve hint; its code names no draft type
  formats.py   FORMATS (vllm, sglang, hf) and the WRITERS / READERS / HINTS tables per format
  export_cli.py (train/)  the verb's arguments, parsed without importing this package

The tokenizer files of --draft (or of --tokenizer PATH, e.g. the target's directory) are copied
beside the weights. A standalone draft must have them: specdistill serve / speculate / drift and
Transformers load a standalone draft's tokenizer from its own directory, so an export without
one is refused, naming the missing files and --tokenizer. An EAGLE-3 head uses its verifier's
tokenizer (vLLM and SGLang load it from the target), so a head without tokenizer files is
exported with a note saying so. The number of speculative tokens
written into a speculators config (and shown in the serve hint) is --speculative-tokens, else
the depth the head was trained at (config.json's `ttt_steps`, recorded by the trainer), else
the training recipe's draft.ttt_steps (recipe.yaml in --draft, or beside it when --draft is a
run's `final/`), else 3, with a note.

Before anything is written the draft is checked: its weight files must be readable (a
`BrokenWeightsError` naming a cut-short file) and cover its config (an `IncompleteDraftError`
naming the missing, unexpected or other-shaped tensors: models/weights.py) and hold no NaN or
infinity (a `NonFiniteWeightsError` naming the file and the tensor); for a head, its
d2t / t2d map (a `VocabMapError` when missing or inconsistent); what the format can hold; the
verifier; the tokenizer files. A
non-empty --out is refused unless --overwrite; the export is written to a temporary directory
beside --out, re-read and checked, then renamed into place (`specdistill.publish`).
`load_export(out, fmt)` re-loads any export as a module giving logits (an `Eagle3Head`, or the
causal LM).

A new draft type (drafts/<type>/) plugs in with its `capabilities` (`formats`, `export_as`),
its `exports` (its writers, readers and hints, in its own subpackage), a `layout` (the format
whose directory layout its saved drafts have) and `detect`, and its registration: nothing
here changes.
"""

import shutil
import sys
import tempfile
from pathlib import Path

from torch import nn

from specdistill import bounds, drafts
from specdistill.bounds import MAX_GAMMA
from specdistill.drafts.export import ExportError, Options, Plan
from specdistill.drafts.vocab_map import VocabMapError
from specdistill.models.hub import TokenizerMismatchError, check_tokenizers, load_tokenizer
from specdistill.models.weights import check_module_finite, check_weight_files
from specdistill.publish import publish_dir
from specdistill.train.export import formats
from specdistill.train.export.formats import FORMATS

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
# A directory has a tokenizer when it has its config and one of these vocabulary files.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")

__all__ = [
    "ExportError",
    "FORMATS",
    "Options",
    "VocabMapError",
    "export",
    "export_with_plan",
    "load_export",
    "serve_hint",
]


def _format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


# ----------------------------------------------------------------------------- reading drafts


def _read(directory: Path) -> tuple[type, nn.Module]:
    """(draft type, module) of a draft directory, read by its type's reader of its layout."""
    try:
        kind = drafts.detect(directory)
    except ValueError as e:  # no config.json, bad JSON: not a draft directory
        raise ExportError(str(e)) from e
    check_weight_files(directory)  # BrokenWeightsError naming a cut-short file
    return kind, formats.readers(kind.layout)[kind.capabilities.export_as](directory)


def load_draft(draft) -> tuple[type, nn.Module]:
    """(draft type, module) for a draft directory, or an in-memory `Eagle3Head` / causal LM;
    a `NonFiniteWeightsError` when its weights hold a NaN or an infinity (models/weights.py)."""
    if isinstance(draft, nn.Module):
        check_module_finite("the draft in memory", draft)
        return drafts.detect(draft), draft
    directory = Path(draft)
    if not directory.is_dir():
        raise ExportError(f"draft directory {directory} does not exist")
    kind, model = _read(directory)
    check_module_finite(directory, model)
    return kind, model


def load_export(out, fmt: str) -> nn.Module:
    """Re-load an export: an `Eagle3Head` (vllm / hf / sglang heads) or the causal LM."""
    _format(fmt)
    return _read(Path(out))[1]


# ----------------------------------------------------------------------------- export


def _prepare_out(out: Path, overwrite: bool, draft) -> None:
    if not isinstance(draft, nn.Module):
        src = Path(draft).resolve()
        dst = out.resolve()
        if dst == src or src in dst.parents or dst in src.parents:
            raise ExportError(f"--out {out} must not be, contain or lie inside --draft {draft}")
    if out.exists():
        if not out.is_dir():
            raise ExportError(f"--out {out} exists and is not a directory")
        if any(out.iterdir()) and not overwrite:
            raise ExportError(f"--out {out} is not empty; pass --overwrite to replace it")


def has_tokenizer(directory: Path | None) -> bool:
    """tokenizer_config.json and a vocabulary file (tokenizer.json, vocab.json, ...)."""
    return (
        directory is not None
        and (directory / "tokenizer_config.json").is_file()
        and any((directory / name).is_file() for name in VOCABULARY_FILES)
    )


def _tokenizer_source(kind: type, options: Options) -> Path | None:
    """The directory whose tokenizer files the export carries: --tokenizer, else --draft.
    A standalone draft without one is refused; a head without one gets a note (and the
    tokenizer files it has)."""
    if options.tokenizer is not None:
        if not has_tokenizer(options.tokenizer):
            raise ExportError(
                f"--tokenizer {options.tokenizer} has no tokenizer files (tokenizer_config.json "
                f"and one of {', '.join(VOCABULARY_FILES)}); name the target's directory"
            )
        return options.tokenizer
    if has_tokenizer(options.source):
        return options.source
    where = f"--draft {options.source}" if options.source is not None else "the in-memory draft"
    if getattr(kind, "own_tokenizer", False):  # a type that declares none uses the target's
        raise ExportError(
            f"{where} has no tokenizer files (tokenizer_config.json and one of "
            f"{', '.join(VOCABULARY_FILES)}); a {kind.name} draft is loaded with its own "
            "tokenizer (specdistill serve / speculate, Transformers): pass --tokenizer PATH "
            "(e.g. the target's directory) to copy its tokenizer into the export"
        )
    print(
        f"note: {where} has no complete tokenizer (tokenizer_config.json and a vocabulary "
        f"file); the {kind.name} export carries none (vLLM and SGLang take the tokenizer from "
        "the verifier); pass --tokenizer PATH to include one",
        file=sys.stderr,
    )
    return options.source  # whatever tokenizer files it has (e.g. tokenizer_config.json)


def _check_tokenizer_fits(tokenizer: Path, kind: type, model, source: Path | None) -> None:
    """ExportError unless `--tokenizer` is the draft's: its vocabulary equal to the tokenizer
    the draft directory carries (when it carries one), and no id past the draft's vocabulary."""
    try:
        given = load_tokenizer(str(tokenizer))
    except (OSError, ValueError) as e:
        raise ExportError(f"--tokenizer {tokenizer}: cannot load it ({e})") from None
    if source is not None and has_tokenizer(source):
        try:
            check_tokenizers(given, load_tokenizer(str(source)), str(tokenizer), str(source))
        except TokenizerMismatchError as e:
            raise ExportError(
                f"--tokenizer {tokenizer} is not the draft's tokenizer: {e}"
            ) from None
    vocab_size = kind.vocab_size_of(model)
    if len(given) > vocab_size:
        raise ExportError(
            f"--tokenizer {tokenizer} has {len(given)} tokens, more than the {vocab_size} of the "
            f"{kind.name} draft: pass the tokenizer the draft was trained with (its target's)"
        )


def _copy_tokenizer(source: Path | None, out: Path) -> None:
    for name in TOKENIZER_FILES if source is not None else ():
        path = source / name
        if path.is_file():
            shutil.copy2(path, out / name)


def _check_written(directory: Path, kind: type, fmt: str) -> None:
    """The export must read back as the draft type it was written from (each format's writer
    has re-read its own weights and vocabulary map already)."""
    written = drafts.detect(directory)
    if written.name != kind.name:
        raise ExportError(
            f"the {fmt} export of a {kind.name} draft reads back as a {written.name} draft"
        )


def export_with_plan(
    draft, fmt: str, out, options: Options, overwrite: bool = False
) -> tuple[Path, type, Plan]:
    """`export` with its `Options` given whole; returns (out, the draft's type, the plan
    written), which `serve_hint` turns into the engine's command line."""
    _format(fmt)
    if options.speculative_tokens is not None:
        try:
            bounds.check_int("--speculative-tokens", options.speculative_tokens, 1, MAX_GAMMA)
        except bounds.BoundsError as e:
            raise ExportError(str(e)) from None
    out = Path(out)
    _prepare_out(out, overwrite, draft)
    kind, model = load_draft(draft)
    can = kind.capabilities
    if fmt not in can.formats:
        raise ExportError(
            f"a {kind.name} draft cannot be exported as {fmt}; formats: {', '.join(can.formats)}"
            + (f" ({can.format_note})" if can.format_note else "")
        )
    plan = formats.writers(fmt)[can.export_as](model, options)  # checks; nothing written yet
    tokenizer = _tokenizer_source(kind, options)
    if options.tokenizer is not None:
        _check_tokenizer_fits(options.tokenizer, kind, model, options.source)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        plan.write(tmp)
        _copy_tokenizer(tokenizer, tmp)
        _check_written(tmp, kind, fmt)
        publish_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, kind, plan


def export(
    draft,
    fmt: str,
    out,
    verifier: str | None = None,
    *,
    overwrite: bool = False,
    speculative_tokens: int | None = None,
    tokenizer=None,
) -> Path:
    """Export `draft` (a directory, or an in-memory `Eagle3Head` / causal LM) as `fmt` in `out`.

    `tokenizer`: a directory whose tokenizer files the export carries (default: the draft's).
    Returns the path written. Raises `VocabMapError` for a bad d2t / t2d map,
    `IncompleteDraftError` / `BrokenWeightsError` / `NonFiniteWeightsError` for weights that
    do not cover the config, cannot be read or hold NaN or infinite values, and `ExportError`
    for a draft the format cannot hold, a standalone draft without tokenizer files or an
    unusable `out`; in every case nothing is written.
    """
    source = None if isinstance(draft, nn.Module) else Path(draft)
    tokenizer = Path(tokenizer) if tokenizer is not None else None
    options = Options(source, verifier, speculative_tokens, tokenizer)
    return export_with_plan(draft, fmt, out, options, overwrite)[0]


def serve_hint(fmt: str, kind, out, plan: Plan) -> str:
    """How the inference engine of `fmt` serves an export (`export_with_plan`'s result)."""
    tokens = plan.speculative_tokens
    can = kind.capabilities
    if "vllm" not in can.formats:  # only this project loads it
        return f"specdistill serve --target {plan.verifier or 'TARGET'} --draft {out}"
    return formats.hints(fmt)[can.export_as].format(
        out=out, target=plan.verifier or "TARGET", tokens=tokens, draft_tokens=tokens + 1
    )
