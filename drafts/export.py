"""What a draft type contributes to the export (`specdistill export`, train/export/), and what
its writers share: the error, the options and plan, a draft directory's files.

Each type declares, beside its `capabilities` (`formats`, `export_as`), its `exports`: an
`Exports` record, written in the type's own subpackage (drafts/<type>/), of
  writers[format](model, options) -> Plan   checks the draft and decides what is written;
                                            no I/O to --out: `Plan.write(directory)` writes
  readers[layout](directory) -> nn.Module   reads a directory in that format's layout back
                                            (a saved draft's `layout`, or an export's format)
  hints[format]                             the serve command printed after an export
The export verb (train/export/) assembles its per-format tables from the registered types'
records, keyed by their `capabilities.export_as` (types that write alike share one record),
and never names a type. The verifier a writer names or checks: drafts/verifier.py.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from safetensors import safe_open

from specdistill.drafts.registry import read_config
from specdistill.errors import UserError

WEIGHTS = "model.safetensors"
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class ExportError(UserError):
    """The draft cannot be exported in the requested format (or --out is not usable)."""


@dataclass(frozen=True)
class Options:
    """What the caller asked for, beyond the draft and the format."""

    source: Path | None = None  # the draft directory (None: an in-memory draft)
    verifier: str | None = None  # --verifier
    speculative_tokens: int | None = None  # --speculative-tokens
    tokenizer: Path | None = None  # --tokenizer: where the export's tokenizer files come from


@dataclass
class Plan:
    """A format's decision for one draft, made (and checked) before anything is written."""

    write: Callable[[Path], None]  # writes the export into an empty directory
    verifier: str | None  # the target the export names, or was checked against
    speculative_tokens: int  # proposal length (serve hint)


Writer = Callable[..., Plan]  # (draft module, Options) -> Plan
Reader = Callable[[Path], object]  # (directory) -> the draft module it holds


@dataclass(frozen=True)
class Exports:
    """A draft type's row of the export's format tables (the module docstring): its writer
    per format, its reader per layout, its serve hint per format. The formats a type may be
    exported as are its `capabilities.formats` (a variant may list fewer than its writers)."""

    writers: Mapping[str, Writer]
    readers: Mapping[str, Reader]
    hints: Mapping[str, str] = field(default_factory=dict)


# ----------------------------------------------------------------------------- draft files


def config_of(directory: Path) -> dict | None:
    """config.json of `directory` as a dict (None without one); bad JSON is an ExportError."""
    try:
        return read_config(directory)
    except ValueError as e:
        raise ExportError(str(e)) from e


def weights_dtype(directory: Path) -> torch.dtype | None:
    """The floating dtype the weights were saved in (kept through the export)."""
    path = directory / WEIGHTS
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            dtype = _SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype())
            if dtype is not None:
                return dtype
    return None


def recipe_value(directory: Path | None, section: str, key: str):
    """`section.key` of the draft's training recipe: recipe.yaml in `directory`, or beside it
    when it is a run's `final/` (the first that sets it); None when none does."""
    if directory is None:
        return None
    candidates = [directory / "recipe.yaml"]
    if directory.name == "final":  # the trainer writes <output_dir>/{recipe.yaml, final/}
        candidates.append(directory.parent / "recipe.yaml")
    for candidate in candidates:
        if candidate.is_file():
            raw = yaml.safe_load(candidate.read_text()) or {}
            part = raw.get(section) if isinstance(raw, dict) else None
            value = part.get(key) if isinstance(part, dict) else None
            if value is not None:
                return value
    return None
