"""A top-N target with its remaining mass, compared on N + 1 bins (docs/theory.md §3,
"Sparse targets with a rest bin").

Pure tensor functions under :func:`losses.api.prepare`. The N stored tokens are target ids;
for a draft over a truncated vocabulary V_d (``d2t``) each is turned into its draft column,
and a stored token outside V_d leaves an empty slot: p there is not compared, as the mass
outside V_d is not with a dense target (docs/theory.md §3, "Truncated draft vocabulary").
"""

import torch
from torch import Tensor

from specdistill.losses.divergences import LOG_P_FLOOR


def check_rest_bin(temperature: float, top_p: float | None, top_k: int | None) -> None:
    """The rest bin is the target at temperature 1, unfiltered: ValueError otherwise."""
    if temperature != 1.0 or top_p is not None or top_k is not None:
        raise ValueError(
            "a SparseTarget with rest is the target at temperature 1, unfiltered: the mass of "
            "its dropped tokens at another temperature or under top-p/top-k is unknown "
            f"(got temperature={temperature}, top_p={top_p}, top_k={top_k})"
        )


def draft_columns(indices: Tensor, probs: Tensor, draft_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Target ids [..., N] -> (draft columns [..., N], −1 for a token outside V_d; probs
    [..., N] with 0 in those slots). `draft_ids` [V_d]: the target id of each draft
    column. Negative ids (masked rows' placeholders) are treated as outside V_d."""
    size = int(torch.maximum(draft_ids.max(), indices.max())) + 1
    to_column = torch.full((size,), -1, dtype=torch.long, device=indices.device)
    to_column[draft_ids] = torch.arange(len(draft_ids), device=indices.device)
    columns = torch.where(indices >= 0, to_column[indices.clamp_min(0)], -1)
    return columns, probs.masked_fill(columns < 0, 0.0)


def rest_bins(
    draft_logp: Tensor, columns: Tensor, probs: Tensor, rest: Tensor, total: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor]:
    """Both sides on N + 1 bins: (draft log-probabilities, target log-probabilities)
    [..., N + 1].

    draft_logp [..., V]: the draft's normalised log-probabilities; columns [..., N]: the N
    tokens' columns, −1 for an empty slot; probs [..., N] (0 in empty slots) and rest [...]:
    the target's mass on the N tokens and off them; total [...]: the mass they are divided
    by (their sum with the empty slots' mass, which absorbs storage rounding). The draft's
    rest bin is the logsumexp of its log-probabilities off the N columns (exact and
    differentiable, also when that mass is tiny), at least LOG_P_FLOOR. An empty slot holds
    no target mass and the draft's log-probability LOG_P_FLOOR there (q ≈ 1e-38), so it adds
    nothing a float32 sum can see to any divergence or to α."""
    empty = columns < 0
    if not empty.any():
        top = draft_logp.gather(-1, columns)
        off = draft_logp.scatter(-1, columns, float("-inf")).logsumexp(-1, keepdim=True)
    else:
        safe = columns.clamp_min(0)
        top = draft_logp.gather(-1, safe).masked_fill(empty, LOG_P_FLOOR)
        taken = torch.zeros(draft_logp.shape, dtype=torch.uint8, device=draft_logp.device)
        taken.scatter_reduce_(-1, safe, (~empty).to(torch.uint8), "amax")  # duplicates: any
        off = draft_logp.masked_fill(taken.bool(), float("-inf")).logsumexp(-1, keepdim=True)
    # Where the N columns are all the draft has, the rest lies wholly outside its columns:
    # uncompared, as a stored token outside V_d is (and the bin's floor keeps it finite).
    covered = (off[..., 0] == float("-inf")) & (probs.sum(-1) > 0)
    rest = torch.where(covered, 0.0, rest)
    bins = torch.cat([probs, rest[..., None]], -1)
    target_logp = (bins / torch.where(mask, total, 1.0)[..., None]).log()
    target_logp.masked_fill_(~mask[..., None], 0.0)  # finite placeholders in masked rows
    return torch.cat([top, off.clamp_min(LOG_P_FLOOR)], -1), target_logp
