"""Online calibration of predicted acceptance: what the draft-length policy
(eval/length_policy.py) multiplies.

A drafter's prediction (drafts/confidence.py) is a probability, but the proxy without an
acceptance head, the draft's own probability of its token, is not the chance that the target
accepts it (at T = 1 a flat draft gives q(x) ≈ 0.02 to tokens accepted two times in three).
`Calibration` maps a raw prediction to the acceptance measured so far for predictions like
it. Each bin counts the drafts verification reached (accepted, or the first rejection), how
many were accepted and the sum of their raw predictions. Two maps:

- the proxy's (`head=False`): bins over log10(raw) in [`LOW`, 0]; a bin's estimate is its
  measured acceptance, shrunk towards the pooled rate with `prior` pseudo-observations;
- an acceptance head's (`head=True`): its prediction is already a probability of acceptance
  (trained to be, at its label's temperature), whose spread within a bin is what tells rows
  apart. The estimate is the prediction plus its bin's measured bias (realised − predicted),
  shrunk towards the pooled bias; bins are equal-width over [0, 1]. Before any observation
  the prediction passes unchanged; served at another temperature than its labels' (greedy
  acceptance is 0 or 1, α at T = 1 is softer), the per-bin bias moves it.
"""

import math

LOW = -4.0  # log10 of the smallest raw prediction with a bin of its own (the proxy's map)


class Calibration:
    """raw predicted acceptance -> measured acceptance (module docstring)."""

    def __init__(self, bins: int = 16, prior: float = 4.0, *, head: bool = False):
        if bins < 1 or prior <= 0:
            raise ValueError(f"calibration needs bins ≥ 1 and prior > 0, got {bins}, {prior}")
        self.bins, self.prior, self.head = bins, prior, head
        self.accepted = [0.0] * bins
        self.reached = [0.0] * bins
        self.predicted = [0.0] * bins  # Σ raw prediction of the reached drafts
        self.totals = [0.0, 0.0, 0.0]  # accepted, reached, predicted over all bins

    def _bin(self, raw: float) -> int:
        if self.head:
            return min(self.bins - 1, max(0, int(raw * self.bins)))
        x = math.log10(max(raw, 10**LOW))
        return min(self.bins - 1, int((x - LOW) / -LOW * self.bins))

    def pooled(self) -> float:
        """The acceptance over every observed draft (Laplace-smoothed; 0.5 before any)."""
        return (self.totals[0] + 1.0) / (self.totals[1] + 2.0)

    def __call__(self, raw: float) -> float:
        b = self._bin(raw)
        if not self.head:
            return (self.accepted[b] + self.prior * self.pooled()) / (self.reached[b] + self.prior)
        accepted, reached, predicted = self.totals
        pooled_bias = (accepted - predicted) / (reached + self.prior)
        bias = (self.accepted[b] - self.predicted[b] + self.prior * pooled_bias) / (
            self.reached[b] + self.prior
        )
        return min(1.0, max(0.0, raw + bias))

    def observe(self, raw: list[float], drafted: int, accepted: int) -> None:
        """A row proposed `drafted` drafts with raw predictions `raw`; `accepted` were."""
        for j in range(min(accepted + 1, drafted)):
            b, hit = self._bin(raw[j]), float(j < accepted)
            self.reached[b] += 1.0
            self.accepted[b] += hit
            self.predicted[b] += raw[j]
            self.totals[0] += hit
            self.totals[1] += 1.0
            self.totals[2] += raw[j]
