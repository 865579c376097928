"""Losses for training speculative-decoding drafts: divergences between the draft q and
the target p, acceptance α = Σ min(p, q), and their masked sums (docs/theory.md §1, §3).

Every loss entry point returns ``(loss_sum, n_valid)`` (multi_depth_loss adds per-depth α):
divide once by the global number of valid positions. See :mod:`losses.api` for the target
forms (logits, probabilities as log-probs, SparseTarget, truncated draft vocabulary via
d2t) and the sampling parameters (temperature, top_p, top_k), and :mod:`losses.sampling`
for the one sampling filter (`filter_logits`, `probabilities`) the engine uses too,
:mod:`losses.acceptance_head` for the acceptance head's label (α) and loss, and
:mod:`losses.resolved` for a loss resolved once (a name's parts, its chain part, its
sampling settings), which a training step evaluates without checking it again.
"""

from specdistill.losses.acceptance_head import acceptance_head_loss, acceptance_label
from specdistill.losses.api import SparseTarget, VocabTarget, acceptance, compute_loss
from specdistill.losses.chunked import chunked_loss
from specdistill.losses.divergences import LOSSES
from specdistill.losses.multi_depth import multi_depth_loss
from specdistill.losses.sampling import filter_logits, probabilities

__all__ = [
    "LOSSES",
    "SparseTarget",
    "VocabTarget",
    "acceptance",
    "acceptance_head_loss",
    "acceptance_label",
    "chunked_loss",
    "compute_loss",
    "filter_logits",
    "multi_depth_loss",
    "probabilities",
]
