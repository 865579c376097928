"""Export a trained draft for an inference engine: vLLM, SGLang or a Hugging Face directory.

    specdistill export --draft runs/code/final --format vllm --out exports/code-vllm
    specdistill export --draft runs/eagle/final --format sglang --out exports/eagle-sgl \
        --verifier Qwen/Qwen2.5-Coder-7B-Instruct [--speculative-tokens N] [--overwrite]

(`python -m specdistill.train.export ...` is the same command.) The draft's type is detected
by the drafts layer (`drafts.detect`: an EAGLE-3 head in the speculators or SGLang layout, else
a Hugging Face causal LM). Each format is one module, which maps a type's `name` to its writer,
reader and serve hint (train/export/common.py describes the interface; docs/theory.md §5):

  vllm.py    an EAGLE-3 head in the `speculators` layout; a standalone draft as a plain causal
             LM directory (config.json, model.safetensors, generation config), for every format
  sglang.py  an EAGLE-3 head as `LlamaForCausalLMEagle3` (feature layer ids shifted by one)
  hf.py      what vllm writes: the layout of EAGLE-3 repositories on the Hugging Face Hub
  verifier.py  the target named in (or checked against) the export, shared by all formats

The tokenizer files of --draft are copied beside the weights. The number of speculative tokens
written into a speculators config (and shown in the serve hint) is --speculative-tokens, else
the depth the head was trained at (config.json's `ttt_steps`, recorded by the trainer), else
the training recipe's draft.ttt_steps (recipe.yaml in --draft, or beside it when --draft is a
run's `final/`), else 3, with a note.

Before anything is written the draft is checked (for a head: its d2t / t2d map, a
`VocabMapError` when missing or inconsistent; what the format can hold; the verifier). A
non-empty --out is refused unless --overwrite; the export is written to a temporary directory
beside --out, re-read and checked, then renamed into place (`specdistill.publish`).
`load_export(out, fmt)` re-loads any export as a module giving logits (an `Eagle3Head`, or the
causal LM).

A new draft type (drafts/) plugs in with a `formats` tuple, a `layout` (the format whose
directory layout its saved drafts have) and `detect`; each format module it supports gets
`WRITERS[name]`, `HINTS[name]`, and its layout module `READERS[name]`.
"""

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from torch import nn

from specdistill import drafts
from specdistill.drafts.eagle3_head import VocabMapError
from specdistill.publish import publish_dir
from specdistill.train.export import hf, sglang, vllm
from specdistill.train.export.common import ExportError, Options, Plan

MODULES = {"vllm": vllm, "sglang": sglang, "hf": hf}
FORMATS = tuple(MODULES)
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

__all__ = ["ExportError", "FORMATS", "export", "load_export", "main", "VocabMapError"]


def _format(fmt: str):
    if fmt not in MODULES:
        raise ExportError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return MODULES[fmt]


# ----------------------------------------------------------------------------- reading drafts


def _read(directory: Path) -> tuple[type, nn.Module]:
    """(draft type, module) of a draft directory, read by its layout's format module."""
    try:
        kind = drafts.detect(directory)
    except ValueError as e:  # no config.json, bad JSON: not a draft directory
        raise ExportError(str(e)) from e
    return kind, MODULES[kind.layout].READERS[kind.name](directory)


def load_draft(draft) -> tuple[type, nn.Module]:
    """(draft type, module) for a draft directory, or an in-memory `Eagle3Head` / causal LM."""
    if isinstance(draft, nn.Module):
        return drafts.detect(draft), draft
    directory = Path(draft)
    if not directory.is_dir():
        raise ExportError(f"draft directory {directory} does not exist")
    return _read(directory)


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


def _export(draft, fmt: str, out, options: Options, overwrite: bool) -> tuple[Path, type, Plan]:
    module = _format(fmt)
    if options.speculative_tokens is not None and options.speculative_tokens < 1:
        raise ExportError(f"--speculative-tokens must be >= 1, got {options.speculative_tokens}")
    out = Path(out)
    _prepare_out(out, overwrite, draft)
    kind, model = load_draft(draft)
    if fmt not in kind.formats:
        raise ExportError(
            f"a {kind.name} draft cannot be exported as {fmt}; formats: {', '.join(kind.formats)}"
        )
    plan = module.WRITERS[kind.name](model, options)  # checks; nothing is written yet

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        plan.write(tmp)
        _copy_tokenizer(options.source, tmp)
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
) -> Path:
    """Export `draft` (a directory, or an in-memory `Eagle3Head` / causal LM) as `fmt` in `out`.

    Returns the path written. Raises `VocabMapError` for a bad d2t / t2d map and
    `ExportError` for a draft the format cannot hold or an unusable `out`; in both cases
    nothing is written.
    """
    source = None if isinstance(draft, nn.Module) else Path(draft)
    options = Options(source, verifier, speculative_tokens)
    return _export(draft, fmt, out, options, overwrite)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specdistill export",
        description="Export a trained draft (EAGLE-3 head or standalone causal LM) for "
        "vLLM, SGLang or the Hugging Face Hub layout.",
    )
    parser.add_argument("--draft", required=True, help="trained draft directory")
    parser.add_argument("--format", required=True, choices=FORMATS, dest="fmt")
    parser.add_argument("--out", required=True, help="output directory (must be empty)")
    parser.add_argument(
        "--verifier",
        default=None,
        help="target model id or path written into a speculators config "
        "(default: the training recipe's target, else the draft config's verifier)",
    )
    parser.add_argument(
        "--speculative-tokens",
        type=int,
        default=None,
        metavar="N",
        help="speculative tokens per step written into the export (default: the head's "
        "training depth, else the training recipe's draft.ttt_steps, else 3)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = parser.parse_args(argv)
    options = Options(Path(args.draft), args.verifier, args.speculative_tokens)
    try:
        out, kind, plan = _export(args.draft, args.fmt, args.out, options, args.overwrite)
    except (ValueError, OSError) as e:  # ExportError, VocabMapError, unreadable drafts
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.fmt} export of the {kind.name} draft to {out}")
    tokens = plan.speculative_tokens
    hint = (
        MODULES[args.fmt]
        .HINTS[kind.name]
        .format(out=out, target=plan.verifier or "TARGET", tokens=tokens, draft_tokens=tokens + 1)
    )
    print("serve with: " + hint)
    return 0
