"""A draft loaded for a target it must fit: the server's draft (--draft, each hot-swapped
version) and the online job's published versions.

Before the model is built, the config's shapes are checked against the weight files' headers
(`check_before_loading`), so a config of other shapes allocates nothing; then the draft is
loaded all or nothing (drafts/loader.py) and checked against the target: its tokenizer (a draft
with its own) or the vocabulary it covers, and the hidden size an EAGLE-3 head was built for.
"""

from pathlib import Path

import torch

from specdistill.drafts.loader import load_draft
from specdistill.drafts.registry import detect, type_of
from specdistill.errors import UserError
from specdistill.models.hub import check_tokenizers, load_tokenizer
from specdistill.models.weights import check_header_shapes


def implied_shapes(path: str) -> tuple[dict[str, tuple], list[set[str]]]:
    """(name -> shape of every tensor the config at `path` implies, groups of names sharing
    one tensor), from the model its type (`detect`) builds on the meta device (`meta_model`):
    nothing is allocated."""
    with torch.device("meta"):
        model = detect(path).meta_model(path)
    state = model.state_dict(keep_vars=True)
    groups: dict[int, set[str]] = {}
    for name, tensor in state.items():
        groups.setdefault(id(tensor), set()).add(name)
    tied = [names for names in groups.values() if len(names) > 1]
    return {name: tuple(t.shape) for name, t in state.items()}, tied


def check_before_loading(path: str) -> None:
    """Refuse (`IncompleteDraftError`) a local draft directory whose weight files' headers
    lack tensors its config implies or hold them in other shapes, before any tensor is
    allocated."""
    if not (Path(path) / "config.json").is_file():
        return  # not a local model directory: the loader says what it is
    shapes, tied = implied_shapes(path)
    check_header_shapes(path, shapes, tied)


def load_checked(path: str, target, tokenizer, *, dtype: str = "float32"):
    """A draft loaded from `path`, on the target's device, checked to fit the target; its
    config's shapes are checked against its weights before the model is built."""
    check_before_loading(path)
    draft = load_draft(path, dtype=dtype)
    kind = type_of(draft)
    if kind.own_tokenizer:
        check_tokenizers(tokenizer, load_tokenizer(path), "target", path)
    head = kind.vocab_size_of(draft)
    if kind.own_tokenizer and head < len(tokenizer):
        raise UserError(f"{path}: the draft's head has {head} rows, the tokenizer {len(tokenizer)}")
    if not kind.own_tokenizer and head > len(tokenizer):
        raise UserError(
            f"{path}: the {kind.name} draft covers {head} token ids; the target's tokenizer "
            f"has {len(tokenizer)}: it was trained for another target"
        )
    if not kind.own_tokenizer:
        hidden = getattr(getattr(draft, "config", None), "target_hidden_size", None)
        if hidden is not None and hidden != target.config.hidden_size:
            raise UserError(
                f"{path}: head built for hidden size {hidden}, target has "
                f"{target.config.hidden_size}"
            )
    return draft.to(target.device)
