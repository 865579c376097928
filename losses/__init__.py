"""Losses for training speculative-decoding drafts: divergences between the draft q and
the target p, acceptance α = Σ min(p, q), and their masked sums (REFERENCE §1, §3).

Every loss entry point returns ``(loss_sum, n_valid)`` (multi_depth_loss adds per-depth α):
divide once by the global number of valid positions. See :mod:`losses.api` for the target
forms (logits, probabilities as log-probs, SparseTarget, truncated draft vocabulary via
d2t) and the sampling parameters (temperature, top_p, top_k).
"""

from specdistill.losses.api import SparseTarget, acceptance, compute_loss
from specdistill.losses.chunked import chunked_loss
from specdistill.losses.divergences import LOSSES
from specdistill.losses.multi_depth import multi_depth_loss

__all__ = [
    "LOSSES",
    "SparseTarget",
    "acceptance",
    "chunked_loss",
    "compute_loss",
    "multi_depth_loss",
]
