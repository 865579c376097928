"""Where a distillation step takes the target's numbers from: one `TargetSource` protocol.

A source answers `depths(draft, batch)` with the draft's logits, the target's (dense logits or
sparse top-N targets) and the masks, one entry per depth, as the draft type's `depths` does
with the live target. Three sources:

- `LiveTarget`: a forward of the frozen target (the draft type's own `depths`);
- `IndexedTargets` over a `TargetCache` (train/target_cache.py, the target's cached top-N) or
  over the traffic records' logprobs (`RecordTargets`, train/online/sparse.py): both look
  their rows up by `batch["sequence"]`, the dataset index of each row, which is why such a
  source asks the data order for it (`indexed`).
"""

from typing import Protocol, runtime_checkable

from torch import Tensor

Depths = tuple[list[Tensor], list[Tensor], list[Tensor]]


@runtime_checkable
class TargetSource(Protocol):
    """The target's side of a step's loss."""

    indexed: bool  # True: batches must carry "sequence" (dataset indices of their rows)

    def depths(self, draft, batch: dict) -> Depths:
        """(draft logits per depth, target logits or sparse targets per depth, masks)."""
        ...


class LiveTarget:
    """The frozen target run on each batch, aligned by the draft type (drafts/)."""

    indexed = False

    def __init__(self, kind, target):
        self.kind, self.target = kind, target

    def depths(self, draft, batch: dict) -> Depths:
        return self.kind.depths(draft, self.target, batch)


class IndexedTargets:
    """Targets stored per dataset row: anything with `depths(draft, batch, vocab_size)` that
    finds its rows by `batch["sequence"]` (`TargetCache`, `RecordTargets`)."""

    indexed = True

    def __init__(self, store, vocab_size: int):
        self.store, self.vocab_size = store, vocab_size

    def depths(self, draft, batch: dict) -> Depths:
        return self.store.depths(draft, batch, self.vocab_size)
