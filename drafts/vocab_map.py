"""A draft vocabulary V_d inside the target's V: d2t / t2d maps (an EAGLE-3 head's, and a
reduced-vocabulary standalone draft's, drafts/standalone/reduced_vocab.py).

target_id = i + d2t[i] for draft id i; t2d[v] is True for the V_d target ids. The map is
built from token frequencies (`token_counts`, `build_vocab_map`) and checked on every load
and save (`check_vocab_map`); `logits_to_target` places V_d logits among the target's ids.
"""

import torch
from torch import Tensor

from specdistill.errors import UserError


class VocabMapError(UserError):
    """A d2t / t2d draft-vocabulary map is missing, malformed or inconsistent."""


# ----------------------------------------------------------------------------- vocabulary


def token_counts(dataset, vocab_size: int) -> Tensor:
    """Frequency of every token id among the loss-masked tokens of `dataset`: [vocab_size]."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(len(dataset)):
        item = dataset[i]
        ids = torch.as_tensor(item["input_ids"])[torch.as_tensor(item["loss_mask"]).bool()]
        counts += torch.bincount(ids.clamp_max(vocab_size - 1), minlength=vocab_size)
    return counts


def logits_to_target(logits: Tensor, draft_ids: Tensor, vocab_size: int) -> Tensor:
    """[..., V_d] -> [..., V] with −inf outside V_d (q puts no mass there); `draft_ids` [V_d]:
    the target id of every draft id."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy(-1, draft_ids, logits)


def build_vocab_map(counts: Tensor, draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """The `draft_vocab_size` most frequent target tokens -> (d2t [V_d] int64, t2d [V] bool).

    counts: [V] token frequencies (on the loss-masked training tokens). Ties, and tokens never
    seen, are ordered by id. Draft ids follow target ids in increasing order.
    """
    vocab_size = counts.shape[0]
    if not 0 < draft_vocab_size <= vocab_size:
        raise VocabMapError(
            f"draft vocab size must be in [1, {vocab_size}] (the target's vocab), "
            f"got {draft_vocab_size}"
        )
    # Stable descending sort: equal counts keep increasing id order.
    order = torch.sort(counts.double(), descending=True, stable=True).indices
    ids = order[:draft_vocab_size].sort().values
    d2t = ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t.long(), t2d


def check_vocab_map(d2t: Tensor | None, t2d: Tensor | None, vocab_size: int, draft_vocab_size: int):
    """Raise `VocabMapError` unless d2t / t2d describe the same V_d of distinct target ids."""
    if d2t is None or t2d is None:
        missing = " and ".join(n for n, t in (("d2t", d2t), ("t2d", t2d)) if t is None)
        raise VocabMapError(f"the draft vocabulary map is missing {missing}")
    if d2t.dtype != torch.int64 or tuple(d2t.shape) != (draft_vocab_size,):
        raise VocabMapError(
            f"d2t must be int64 of shape [{draft_vocab_size}], got {d2t.dtype} {list(d2t.shape)}"
        )
    if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab_size,):
        raise VocabMapError(
            f"t2d must be bool of shape [{vocab_size}], got {t2d.dtype} {list(t2d.shape)}"
        )
    ids = torch.arange(draft_vocab_size, device=d2t.device) + d2t
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise VocabMapError(f"d2t maps draft ids outside the target vocab [0, {vocab_size})")
    if draft_vocab_size > 1 and not bool((ids[1:] > ids[:-1]).all()):
        if ids.unique().numel() != draft_vocab_size:
            raise VocabMapError("d2t maps two draft ids to the same target id")
        raise VocabMapError(
            "d2t must list target ids in increasing order (speculators builds its head as "
            "lm_head[t2d], which assumes it)"
        )
    if int(t2d.sum()) != draft_vocab_size:
        raise VocabMapError(f"t2d marks {int(t2d.sum())} target ids, d2t has {draft_vocab_size}")
    if not bool(t2d[ids.to(t2d.device)].all()):
        bad = int(ids[~t2d[ids.to(t2d.device)].to(ids.device)][0])
        raise VocabMapError(f"d2t and t2d disagree: target id {bad} is in d2t but not in t2d")


# ----------------------------------------------------------------------------- target features
