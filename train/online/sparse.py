"""The target of a refresh taken from its records' own `top_logprobs` (the target's raw top-k
at temperature 1, docs/traffic.md) instead of a forward of the target: each position a
`SparseTarget` of the k logged tokens plus a rest bin holding 1 − Σ p (docs/theory.md §3).

The ids were checked when the line was read (distinct: the traffic schema; in the target's
vocabulary: train/online/screen.py), so they are used as they are here.
"""

import numpy as np
import torch

from specdistill.drafts.align import target_mask
from specdistill.formats.traffic import TrafficError
from specdistill.train.online.kept import KeptRecord
from specdistill.train.target_cache import place_sparse_rows


class RecordTargets:
    """The interface of `train.target_cache.TargetCache` (`depths`), which the Trainer uses
    in place of the live target; rows are found by `batch["sequence"]`, indices into
    `items`."""

    def __init__(self, items: list[KeptRecord], kind):
        self.items, self.kind = items, kind  # kind: the draft's `drafts.types.DraftType`

    def depths(self, draft, batch: dict, vocab_size: int, split: str = "train"):
        mask = target_mask(batch)
        rows = [self.items[i] for i in batch["sequence"].tolist()]
        target = sparse_target(rows, mask, vocab_size)
        return self.kind.stored_depths(draft, batch, target)


def sparse_target(items: list[KeptRecord], mask, vocab_size: int):
    """SparseTarget [B, L−1, k] with rest [B, L−1] from the items' top_logprobs, one entry per
    completion token, placed at the valid positions of `mask` (those predicting a completion
    token, in order; train.target_cache.place_sparse_rows). Entries with fewer than k
    alternatives are padded with unused ids of probability 0."""
    k = max(len(entry) for it in items for entry in it.top_logprobs)
    rows = []
    for it in items:
        entries = it.top_logprobs
        if not it.prompt_token_ids:  # KeptRecord.tokens: the first token is never a target
            entries = entries[1:]
        indices, probs = [], []
        for entry in entries:
            ids = [int(t) for t, _ in entry]
            taken = set(ids)
            unused = (t for t in range(vocab_size) if t not in taken)
            indices.append(ids + [next(unused) for _ in range(k - len(ids))])
            probs.append([float(np.exp(lp)) for _, lp in entry] + [0.0] * (k - len(entry)))
        p = torch.tensor(probs, dtype=torch.float32).reshape(len(entries), k)
        rest = (1.0 - p.sum(-1)).clamp_min(0.0)
        rows.append((torch.tensor(indices, dtype=torch.long).reshape(len(entries), k), p, rest))

    def mismatch(b: int, have: int, want: int) -> Exception:
        return TrafficError(
            f"record {items[b].id}: {have} top_logprobs entries for {want} trained "
            "completion tokens"
        )

    return place_sparse_rows(mask, k, rows, mismatch)
