"""Draft types: everything that differs between a standalone draft and an EAGLE-3 head.

The trainer, the offline evaluation, the engine and the export ask this layer and never
branch on the type themselves. A draft type (drafts/standalone.py, drafts/eagle3.py) turns a
batch into K aligned (draft logits, target logits, mask) depths (`depths`, `count_mask`),
saves a trained draft (`save`), and knows its own directories (`detect`). Both go to
`losses.multi_depth_loss` (K = 1 is the plain per-position loss) and to `eval.offline` for
α per depth. For a loaded draft module, `type_of` gives its type, whose `drafter` (also
`drafter_for`) is the engine's proposer on its own KV cache (drafts/kv_cache.py), whose
`vocab_size_of` counts its logit columns and whose `path_logits` gives the teacher-forced
logits of the offline α along generated text (eval/stats.py).

Adding a type (an MTP or DFlash-style head): a module here with a class of the same
interface, one entry in `TYPES` and one in `DETECTED` (before `Standalone`, the fallback).
"""

from pathlib import Path

from torch import nn

from specdistill.drafts.eagle3 import Eagle3, SGLangEagle3
from specdistill.drafts.standalone import Standalone

TYPES = {"standalone": Standalone, "eagle3": Eagle3}
# Asked in this order by `detect`; Standalone (any HF model directory) is the fallback, last.
DETECTED = (Eagle3, SGLangEagle3, Standalone)


def build(cfg, target, tokenizer, train_data, *, print=print):
    """(draft module, draft type instance) for a recipe's `draft` section (`cfg.type` names
    the type), built or loaded for `target`; `train_data` gives an EAGLE-3 head its V_d."""
    return TYPES[cfg.type].build(cfg, target, tokenizer, train_data, print=print)


def detect(draft) -> type:
    """The draft type class of a directory (or of an in-memory draft module).

    Each class's `detect(path)` recognises its own directories; `SGLangEagle3` is an EAGLE-3
    head in SGLang's layout (its `name` is "eagle3"). Raises ValueError for a directory
    without config.json, which is no draft of any type.
    """
    if isinstance(draft, nn.Module):
        return type_of(draft)
    path = Path(draft)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{path}: no config.json; a draft directory is an EAGLE-3 head (speculators or "
            "SGLang layout) or a Hugging Face causal LM directory"
        )
    return next(kind for kind in DETECTED if kind.detect(path))


def type_of(model) -> type:
    """The draft type class of a loaded draft module: `Eagle3` for an EAGLE-3 head (it says
    `is_eagle3`), else `Standalone` (a causal LM). The one place that tells them apart."""
    return Eagle3 if getattr(model, "is_eagle3", False) else Standalone


def drafter_for(model, vocab_size: int, device):
    """The speculative decoding engine's drafter for a loaded draft (eval/engine.py)."""
    return type_of(model).drafter(model, vocab_size, device)


__all__ = [
    "DETECTED",
    "TYPES",
    "Eagle3",
    "SGLangEagle3",
    "Standalone",
    "detect",
    "drafter_for",
    "type_of",
]
