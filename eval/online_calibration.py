"""Online calibration of predicted acceptance: what the draft-length policy
(eval/length_policy.py) multiplies.

A drafter's prediction (drafts/confidence.py) is a probability, but the proxy without an
acceptance head, the draft's own probability of its token, is not the chance that the target
accepts it (at T = 1 a flat draft gives q(x) ≈ 0.02 to tokens accepted two times in three).
`Calibration` maps a raw prediction to the acceptance measured so far for predictions like
it: bins over log10(raw) in [`LOW`, 0], each counting the drafts verification reached
(accepted, or the first rejection) and how many were accepted, shrunk towards the pooled rate
with `prior` pseudo-observations. A calibrated head's predictions pass through nearly
unchanged.
"""

import math

LOW = -4.0  # log10 of the smallest raw prediction with a bin of its own


class Calibration:
    """raw predicted acceptance -> measured acceptance (module docstring)."""

    def __init__(self, bins: int = 16, prior: float = 4.0):
        if bins < 1 or prior <= 0:
            raise ValueError(f"calibration needs bins ≥ 1 and prior > 0, got {bins}, {prior}")
        self.bins, self.prior = bins, prior
        self.accepted = [0.0] * bins
        self.reached = [0.0] * bins

    def _bin(self, raw: float) -> int:
        x = math.log10(max(raw, 10**LOW))
        return min(self.bins - 1, int((x - LOW) / -LOW * self.bins))

    def pooled(self) -> float:
        """The acceptance over every observed draft (Laplace-smoothed; 0.5 before any)."""
        return (sum(self.accepted) + 1.0) / (sum(self.reached) + 2.0)

    def __call__(self, raw: float) -> float:
        b = self._bin(raw)
        return (self.accepted[b] + self.prior * self.pooled()) / (self.reached[b] + self.prior)

    def observe(self, raw: list[float], drafted: int, accepted: int) -> None:
        """A row proposed `drafted` drafts with raw predictions `raw`; `accepted` were."""
        for j in range(min(accepted + 1, drafted)):
            b = self._bin(raw[j])
            self.reached[b] += 1.0
            self.accepted[b] += float(j < accepted)
