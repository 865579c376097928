"""The cost of a speculative round, per batch size: what the draft-length policy
(eval/length_policy.py) weighs acceptance against.

c: one draft step (a draft forward for the whole batch, its sampling and the confidence);
v(k), k = 0..max_gamma: the target's verification pass over k drafts (k + 1 tokens per row)
with its sampling. A round that drafts k tokens costs k·c + v(k) seconds; v(0) is a plain
target step. v is measured at start-up (`measure_verify`: a few timed forwards on a scratch
cache, the fastest of `repeats`) at the engine's batch size; a batch size met later starts
from a copy of the nearest measured one's table. c is measured by the first draft step.
Both then follow the rounds' own timings with an exponential moving average (weight
`weight` on the newest), so that a growing context or a busy machine moves them; an
observed v(k) scales the whole table (`CostModel.observe_verify`). The
policy reads v smoothed (`CostTable.fitted`: a line in k).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdistill.models.kv_cache import KVStream, sync

# Scratch context the start-up measurement verifies after (tokens per row).
CONTEXT = 32


@dataclass
class CostTable:
    """Costs at one batch size, in seconds. draft_s is None until a draft step was timed."""

    verify_s: list[float]  # v(k) for k = 0..max_gamma
    draft_s: float | None = None

    def fitted(self) -> list[float]:
        """v(k) smoothed: the least-squares line a + b·k through the table (b ≥ 0), so that
        timing noise between neighbouring k does not look like a cheaper longer round."""
        n = len(self.verify_s)
        mean_k, mean_v = (n - 1) / 2, sum(self.verify_s) / n
        var = sum((k - mean_k) ** 2 for k in range(n))
        cov = sum((k - mean_k) * (v - mean_v) for k, v in enumerate(self.verify_s))
        slope = max(0.0, cov / var) if var else 0.0
        return [mean_v + slope * (k - mean_k) for k in range(n)]


class CostModel:
    """c and v(k) per batch size; `measure(batch_size) -> [v(0), .., v(max_gamma)]` gives a
    new batch size its start-up table."""

    def __init__(
        self, max_gamma: int, measure: Callable[[int], list[float]], *, weight: float = 0.1
    ):
        if not 0 < weight <= 1:
            raise ValueError(f"the cost model's EMA weight must be in (0, 1], got {weight}")
        self.max_gamma, self.measure, self.weight = max_gamma, measure, weight
        self.tables: dict[int, CostTable] = {}

    def table(self, batch_size: int) -> CostTable:
        """The costs at `batch_size`: a new size starts from the nearest known size's table,
        or is measured when there is none."""
        if batch_size not in self.tables and self.tables:
            nearest = min(self.tables, key=lambda b: (abs(b - batch_size), b))
            t = self.tables[nearest]
            self.tables[batch_size] = CostTable(list(t.verify_s), t.draft_s)
        return self.measured(batch_size)

    def measured(self, batch_size: int) -> CostTable:
        """The costs at `batch_size`, measured now if that size has no table yet."""
        if batch_size not in self.tables:
            verify_s = list(self.measure(batch_size))
            if len(verify_s) != self.max_gamma + 1:
                raise ValueError(
                    f"the cost measurement gave {len(verify_s)} verification costs, "
                    f"expected {self.max_gamma + 1} (k = 0..{self.max_gamma})"
                )
            self.tables[batch_size] = CostTable(verify_s)
        return self.tables[batch_size]

    def observe_draft(self, batch_size: int, seconds: float) -> None:
        """One draft step of the batch took `seconds`."""
        t = self.table(batch_size)
        t.draft_s = seconds if t.draft_s is None else self._ema(t.draft_s, seconds)

    def observe_verify(self, batch_size: int, k: int, seconds: float) -> None:
        """A verification pass over k drafts took `seconds`: v(k) takes its EMA step and
        every other v(j) moves by the same factor. The start-up measurement is the fastest
        of a few bare forwards, while a round's verification also pays for its inputs, its
        sampling and a busy machine; moving only the k that rounds happen to use would leave
        the rest of the table low and make the lengths nobody tries look cheap."""
        t = self.table(batch_size)
        factor = self._ema(t.verify_s[k], seconds) / t.verify_s[k] if t.verify_s[k] > 0 else 1.0
        t.verify_s = [v * factor for v in t.verify_s]
        if t.verify_s[k] <= 0:
            t.verify_s[k] = seconds

    def _ema(self, old: float, new: float) -> float:
        return (1 - self.weight) * old + self.weight * new

    def summary(self) -> dict:
        """{batch size: {"draft_s": c, "verify_s": [v(0), ..]}} (report.json)."""
        return {
            str(b): {"draft_s": t.draft_s, "verify_s": list(t.verify_s)}
            for b, t in sorted(self.tables.items())
        }


@torch.inference_mode()
def measure_verify(
    target,
    vocab_size: int,
    batch_size: int,
    max_gamma: int,
    *,
    repeats: int = 2,
    context: int = CONTEXT,
) -> list[float]:
    """v(k) for k = 0..max_gamma at `batch_size`: the fastest of `repeats` timed target
    forwards of k + 1 tokens per row after a scratch context, each rolled back."""
    device = target.device
    stream = KVStream(target, vocab_size, device)
    ids = torch.arange(batch_size * context, device=device).remainder(vocab_size)
    stream.admit(ids.view(batch_size, context).tolist())
    costs = []
    for k in range(max_gamma + 1):
        tokens = torch.arange(batch_size * (k + 1), device=device).remainder(vocab_size)
        tokens = tokens.view(batch_size, k + 1)
        valid = torch.ones_like(tokens, dtype=torch.bool)
        best = float("inf")
        for _ in range(repeats):
            sync(device)
            start = time.perf_counter()
            stream.forward(tokens, valid, keep=k + 1).float().softmax(-1)
            sync(device)
            best = min(best, time.perf_counter() - start)
            stream.drop_last(torch.full((batch_size,), k + 1, device=device))
        costs.append(best)
    return costs
