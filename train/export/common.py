"""What every export format shares: the error, the options and plan, a draft directory's
files, the number of speculative tokens, and the re-read of a written EAGLE-3 head.

A format module (vllm.py, sglang.py, hf.py) maps how a draft type is written (its
`capabilities.export_as`, drafts/types.py: causal_lm, eagle3_head, parallel_lm) to
  WRITERS[export_as](model, options) -> Plan   checks the draft and decides what is written;
                                               no I/O to --out: `Plan.write(directory)` writes
  READERS[export_as](directory) -> nn.Module   reads a directory in that format's layout back
  HINTS[export_as]                             the serve command printed after an export
"""

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specdistill.drafts.eagle3.head import DEFAULT_SPECULATIVE_TOKENS, read_config
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
    verifier: str | None = None  # the target the export names, or was checked against
    speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS  # proposal length (serve hint)


# ----------------------------------------------------------------------------- draft files


def config_of(directory: Path) -> dict | None:
    """config.json of `directory` as a dict (None without one); bad JSON is an ExportError."""
    try:
        return read_config(directory)
    except ValueError as e:
        raise ExportError(str(e)) from e


def weights_dtype(directory: Path) -> torch.dtype | None:
    """The floating dtype the weights were saved in (kept through the export)."""
    from safetensors import safe_open

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
    import yaml

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


def speculative_tokens(head, options: Options) -> int:
    """--speculative-tokens, else the head's recorded training depth (`ttt_steps`), else the
    training recipe's draft.ttt_steps, else `DEFAULT_SPECULATIVE_TOKENS` with a note."""
    if options.speculative_tokens is not None:
        return options.speculative_tokens
    if getattr(head, "ttt_steps", None):
        return int(head.ttt_steps)
    steps = recipe_value(options.source, "draft", "ttt_steps")
    if steps is not None:
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ExportError(f"the training recipe's draft.ttt_steps is {steps!r}, not >= 1")
        return steps
    print(
        "note: the head records no training depth and no training recipe gives "
        f"draft.ttt_steps; writing {DEFAULT_SPECULATIVE_TOKENS} speculative tokens "
        "(pass --speculative-tokens N to choose)",
        file=sys.stderr,
    )
    return DEFAULT_SPECULATIVE_TOKENS


# ----------------------------------------------------------------------------- after writing


def check_head_files(directory: Path, vocab_size: int, layer: str) -> None:
    """Re-read an EAGLE-3 export: the vocab map and the exact weight names (`layer`: the
    decoder layer's prefix, `layers.0.` or `midlayer.`)."""
    from safetensors import safe_open

    from specdistill.drafts.eagle3.head import check_vocab_map

    config = config_of(directory) or {}
    with safe_open(str(directory / WEIGHTS), framework="pt") as f:
        names = set(f.keys())
        d2t = f.get_tensor("d2t") if "d2t" in names else None
        t2d = f.get_tensor("t2d") if "t2d" in names else None
    check_vocab_map(d2t, t2d, vocab_size, config["draft_vocab_size"])
    expected = {"d2t", "t2d", "embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight"}
    expected |= {
        layer + n
        for n in (
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "input_layernorm.weight",
            "hidden_norm.weight",
            "post_attention_layernorm.weight",
        )
    }
    if names != expected:
        raise ExportError(
            f"export weight names differ from the {layer.rstrip('.')} layout: missing "
            f"{sorted(expected - names)}, unexpected {sorted(names - expected)}"
        )
