"""Offline acceptance: α of a draft against its target on held-out token sequences.

α per position is Σ_x min(p(x), q(x)) at the verifier's temperature (docs/theory.md §1);
at temperature 0 it is argmax agreement. The predicted accepted length per round for a
draft of γ tokens, with i.i.d. acceptance α, is τ(γ) = (1 − α^(γ+1)) / (1 − α),
bonus token included, so τ ∈ [1, γ + 1] (`eval.stats.tau_iid`; per depth `tau_chain`).
"""

from collections.abc import Iterable

import torch

from specdistill import losses
from specdistill.eval.stats import tau_chain, tau_iid


@torch.no_grad()
def acceptance_sums(
    kind, target, draft, batches: Iterable[dict], *, temperature: float
) -> torch.Tensor:
    """Sums over valid positions per draft depth: [K, 3] float64 rows (Σ α_T, Σ α_greedy, n).

    `kind` is a draft type of drafts/ (standalone: K = 1; eagle3: K = TTT steps).
    Returned as sums so that callers running on several processes can all-reduce them.
    """
    sums = None
    for batch in batches:
        drafts, targets, masks = kind.depths(draft, target, batch)
        if sums is None:
            sums = torch.zeros(len(drafts), 3, dtype=torch.float64)
        for k, (d_logits, t_logits, mask) in enumerate(zip(drafts, targets, masks, strict=True)):
            alpha = losses.acceptance(d_logits, t_logits, temperature, mask, d2t=kind.d2t)
            greedy = losses.acceptance(d_logits, t_logits, 0.0, mask, d2t=kind.d2t)
            sums[k, 0] += alpha.double().sum().cpu()
            sums[k, 1] += greedy.double().sum().cpu()
            sums[k, 2] += mask.sum().cpu()
    if sums is None:
        raise ValueError("no evaluation batches")
    return sums


def summarise(sums: torch.Tensor, *, temperature: float, max_gamma: int) -> dict:
    """Turn `acceptance_sums` (possibly all-reduced; [3] or [K, 3]) into the reported metrics.

    One depth: tau_pred is the i.i.d. formula. K depths (EAGLE-3 TTT): `alpha_depth` lists
    the teacher-forced α of each depth and tau_pred chains them (docs/theory.md §1), the last
    depth's α standing in for deeper drafts.
    """
    sums = sums.reshape(-1, 3)
    n = int(sums[0, 2].item())
    if n == 0:
        raise ValueError("no valid positions in the evaluation data (empty loss mask)")
    per_depth = [float(s[0] / s[2]) if s[2] > 0 else 0.0 for s in sums]
    alpha = per_depth[0]
    result = {
        "alpha": alpha,
        "alpha_greedy": float(sums[0, 1] / n),
        "temperature": temperature,
        "n_positions": n,
    }
    if len(per_depth) == 1:
        result["tau_pred"] = {g: tau_iid(alpha, g) for g in range(1, max_gamma + 1)}
    else:
        result["alpha_depth"] = per_depth
        result["alpha_greedy_depth"] = [float(s[1] / s[2]) if s[2] > 0 else 0.0 for s in sums]
        result["tau_pred"] = {g: tau_chain(per_depth, g) for g in range(1, max_gamma + 1)}
    return result
