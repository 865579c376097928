"""The acceptance head's label and loss (docs/theory.md §1, "The acceptance head").

The head (drafts/acceptance_head.py) predicts, at each draft position, the probability that
the target accepts the token the draft proposes there. That event's probability, over the
draft's own proposal x ~ q and the verifier's coin, is Σ_x q(x)·min(1, p(x)/q(x)) =
Σ_x min(p(x), q(x)) = α, the per-position acceptance the losses already compute
(`losses.acceptance`, at the serving temperature and filters). So α is the label: a soft
label in [0, 1] (at temperature 0 the greedy agreement, 0 or 1), and binary cross-entropy
against it is minimised exactly where sigmoid(prediction) = α.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from specdistill.losses.api import Target, acceptance


def acceptance_label(
    draft_logits: Tensor,
    target_logits: Target,
    mask: Tensor | None = None,
    *,
    temperature: float = 1.0,
    top_p: float | None = None,
    top_k: int | None = None,
    d2t: Tensor | None = None,
) -> Tensor:
    """The head's label per position, detached: α = Σ min(p, q) at ``temperature`` (greedy
    agreement at 0), exactly `losses.acceptance` of the same arguments; 0 at masked
    positions. [..., V_d], [..., V] -> [...]."""
    with torch.no_grad():
        return acceptance(
            draft_logits.detach(),
            target_logits,
            temperature,
            mask,
            top_p=top_p,
            top_k=top_k,
            d2t=d2t,
        )


def acceptance_head_loss(
    pred_logits: Tensor,
    draft_logits: Tensor | None,
    target_logits: Target | None,
    mask: Tensor | None = None,
    *,
    temperature: float = 1.0,
    top_p: float | None = None,
    top_k: int | None = None,
    d2t: Tensor | None = None,
    label: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Binary cross-entropy of the head's logits against α, summed over the valid positions.

    Args:
        pred_logits: [...] or [..., 1], the head's output at the draft's positions.
        draft_logits, target_logits, temperature, top_p, top_k, d2t: as for
            `losses.acceptance`; the label is `acceptance_label` of them (detached: the
            draft gets no gradient through the label). Unused when ``label`` is given.
        mask: [...] bool, True = valid; None = all valid. Masked positions contribute
            exactly 0 (NaN included).
        label: [...] the label, when the caller has α already (e.g. from its metrics).

    Returns:
        loss_sum: 0-dim fp32 tensor with grad to pred_logits.
        n_valid: 0-dim int64, the number of valid positions: divide once by the global
            count, like every loss of this package.
    """
    if label is None:
        if draft_logits is None or target_logits is None:
            raise ValueError("acceptance_head_loss needs draft and target logits, or a label")
        label = acceptance_label(
            draft_logits,
            target_logits,
            mask,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            d2t=d2t,
        )
    label = label.detach()
    if pred_logits.dim() == label.dim() + 1 and pred_logits.shape[-1] == 1:
        pred_logits = pred_logits.squeeze(-1)
    if pred_logits.shape != label.shape:
        raise ValueError(
            f"pred_logits {list(pred_logits.shape)} must have the label's shape "
            f"{list(label.shape)} (the draft logits' leading dims), or that shape plus [1]"
        )
    if mask is None:
        mask = torch.ones_like(label, dtype=torch.bool)
    elif mask.shape != label.shape:
        raise ValueError(f"mask {list(mask.shape)} must have shape {list(label.shape)}")
    mask = mask.to(torch.bool)
    dtype = torch.promote_types(pred_logits.dtype, torch.float32)
    pred = torch.where(mask, pred_logits.to(dtype), 0.0)  # no NaN into the gradient
    target = torch.where(mask, label.to(dtype), 0.0).clamp(0.0, 1.0)
    loss = F.binary_cross_entropy_with_logits(pred, target, reduction="none")
    return torch.where(mask, loss, 0.0).sum(), mask.sum()
