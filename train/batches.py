"""The order of a run's data: which sequences each optimiser step and each process sees.

The order is a function of (seed, step) alone: epoch e is one permutation drawn from a
generator seeded with `seed * 100_003 + e`, and step s takes the global batch at positions
[s·G, (s+1)·G) of the concatenated epochs. A resumed run therefore replays exactly what an
uninterrupted one would have seen. Each process takes its contiguous share of the global
batch, in micro-batches. A `Batches` is built from one dataset; a driver whose data changes
(the online job's refreshes) builds a new one for each.
"""

import math

import torch

from specdistill.data import collate
from specdistill.train.config import RecipeError


def accumulation_steps(recipe, accelerator) -> int:
    """Micro-batches per process and optimiser step (a RecipeError when the global batch does
    not split evenly over micro-batches and processes)."""
    t, world = recipe.train, accelerator.num_processes
    per_step = t.micro_batch_size * world
    if t.global_batch_size % per_step:
        raise RecipeError(
            f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
            f"train.micro_batch_size × processes ({t.micro_batch_size} × {world})"
        )
    return t.global_batch_size // per_step


class Batches:
    """Micro-batches of `dataset` for this process, on its device.

    indexed: each training micro-batch carries "sequence", the dataset index of its rows (a
    target source that looks targets up by row needs it). on_policy: a train.on_policy
    `OnPolicy` that replaces some rows with text generated now (needs the live target).
    """

    def __init__(self, dataset, *, recipe, accelerator, pad_token_id: int, indexed=False):
        self.dataset, self.accelerator = dataset, accelerator
        self.seed = recipe.train.seed
        self.global_batch = recipe.train.global_batch_size
        self.micro_batch = recipe.train.micro_batch_size
        self.pad_token_id = pad_token_id
        self.indexed = indexed
        self.on_policy = None
        self._perms: dict[int, torch.Tensor] = {}

    def use_on_policy(self, on_policy) -> None:
        """Generate some rows of each micro-batch with `on_policy` (train/on_policy.py)."""
        self.on_policy = on_policy

    def __len__(self) -> int:
        return len(self.dataset)

    def permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perms = {epoch: torch.randperm(len(self.dataset), generator=g)}
        return self._perms[epoch]

    def micro_batches(self, step: int) -> list[dict]:
        """This process's micro-batches for optimiser step `step` (a pure function of step, and
        with data.on_policy of the draft's weights at that step)."""
        g, n = self.global_batch, len(self.dataset)
        indices = [int(self.permutation(i // n)[i % n]) for i in range(step * g, (step + 1) * g)]
        acc = self.accelerator
        share = g // acc.num_processes
        mine = indices[acc.process_index * share : (acc.process_index + 1) * share]
        mb = self.micro_batch
        batches = [self.collate(mine[i : i + mb]) for i in range(0, share, mb)]
        if self.on_policy is not None:  # some rows generated now (train/on_policy.py)
            if self.indexed:  # online's sparse targets, say: no rows for new text
                raise RecipeError("data.on_policy needs the live target: set fraction=0")
            first = acc.process_index * share
            batches = [self.on_policy.batch(step, first + i * mb, b) for i, b in enumerate(batches)]
        if self.indexed:  # the targets are looked up by dataset index
            for k, batch in enumerate(batches):
                batch["sequence"] = torch.tensor(mine[k * mb : (k + 1) * mb])
        return batches

    def collate(self, indices: list[int]) -> dict:
        batch = collate([self.dataset[i] for i in indices], self.pad_token_id)
        return {k: v.to(self.accelerator.device) for k, v in batch.items()}

    def held_out(self, max_sequences: int) -> list[dict]:
        """This process's share of the first `max_sequences` sequences, in micro-batches (an
        evaluation set). Every process gets the same number of batches (a sharded draft's
        forward is collective): those short of the most are topped up with a copy of
        sequence 0 whose loss_mask is all False, which adds nothing to the sums."""
        acc = self.accelerator
        n = min(len(self.dataset), max_sequences)
        mine = list(range(acc.process_index, n, acc.num_processes))
        mb = self.micro_batch
        batches = [self.collate(mine[i : i + mb]) for i in range(0, len(mine), mb)]
        most = math.ceil(math.ceil(n / acc.num_processes) / mb)
        while len(batches) < most:
            filler = self.collate([0])
            filler["loss_mask"] = torch.zeros_like(filler["loss_mask"])
            batches.append(filler)
        return batches
