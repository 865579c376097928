"""A GGUF file -> a plain Hugging Face model directory (float32 safetensors, tokenizer, chat
template), so that every verb loads it through the ordinary `from_pretrained` path.

transformers reads GGUF itself (`from_pretrained(dir, gguf_file=...)`: it dequantizes the
tensors and undoes llama.cpp's q/k row permutation), but the model it returns carries a
quantization marker under which `save_pretrained` refuses, and reading the GGUF again on
every load would cost seconds. `convert_gguf` reads it once and writes the weights into a
fresh model of the same class and config, without the marker.
"""

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdistill.errors import UserError

SOURCE_RECORD = "specdistill_source.json"  # what the directory was converted from


class GGUFConversionError(UserError):
    """A GGUF file that transformers cannot read as a causal LM with a tokenizer."""


def convert_gguf(
    gguf_path: Path, out: Path, *, source: dict, print: Callable[[str], None] = print
) -> None:
    """Write `gguf_path`'s model as a plain float32 HF directory into `out` (which must exist
    and be empty), with its tokenizer and chat template, and `source` (JSON-able: where the
    file came from, its sha256, ...) as `specdistill_source.json`."""
    gguf_path = Path(gguf_path)
    start = time.monotonic()
    kwargs = {"gguf_file": gguf_path.name, "local_files_only": True}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
        loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), dtype=torch.float32, **kwargs
        )
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        raise GGUFConversionError(
            f"{gguf_path}: transformers cannot read it as a causal LM "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from e
    print(f"  read and dequantized {gguf_path.name} in {time.monotonic() - start:.0f} s")
    config = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)  # the marker save_pretrained refuses; the GGUF's free-text name
    plain_config = type(loaded.config).from_dict(config)
    plain_config.dtype = torch.float32
    model = type(loaded)(plain_config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # A tied output head is one tensor under two names; anything else missing is a bug.
    missing = [m for m in missing if not (plain_config.tie_word_embeddings and "lm_head" in m)]
    if missing or unexpected:
        raise GGUFConversionError(
            f"{gguf_path}: converted weights do not fit {type(loaded).__name__}: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    model.tie_weights()
    model.generation_config = loaded.generation_config
    del loaded
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    for f in Path(out).iterdir():
        f.chmod(0o644)  # as readable as any model directory (safetensors writes 0600)
    (Path(out) / SOURCE_RECORD).write_text(json.dumps(source, indent=2) + "\n")
    size = sum(f.stat().st_size for f in Path(out).glob("*.safetensors"))
    print(
        f"  wrote {type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M"
        f" parameters, {size / 1e6:.0f} MB float32) in {time.monotonic() - start:.0f} s"
    )


def read_source(directory: Path) -> dict | None:
    """The source record of a converted directory, or None for any other model directory."""
    try:
        record = json.loads((Path(directory) / SOURCE_RECORD).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None
