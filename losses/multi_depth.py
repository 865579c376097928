"""Loss over K unrolled draft steps (training-time test, docs/theory.md §3 and §4).

Depth k (0-based) holds the draft's k-th step at each position. The chain of acceptances
at a position is α_0, α_1, ...; Π_{i<=j} α_i is the probability that steps 0..j are all
accepted, so the expected number of accepted drafts is E = Σ_j Π_{i<=j} α_i.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from specdistill.losses.api import (
    SparseTarget,
    Target,
    _check_sampling,
    masked_loss,
    prepare,
)
from specdistill.losses.divergences import check_params, log_acceptance

WEIGHTINGS = ("geometric", "expected_length", "end_to_end")


def multi_depth_loss(
    name: str,
    draft_logits: Sequence[Tensor] | Tensor,
    target_logits: Sequence[Target] | Tensor | SparseTarget,
    masks: Sequence[Tensor] | Tensor | None = None,
    *,
    weighting: str = "geometric",
    decay: float | None = None,
    temperature: float = 1.0,
    top_p: float | None = None,
    top_k: int | None = None,
    d2t: Tensor | None = None,
    mask_out_of_vocab: bool = False,
    **params,
) -> tuple[Tensor, Tensor, Tensor]:
    """Weighted sum over draft depths of the per-position loss ``name``.

    Args:
        draft_logits: K tensors [..., V_d], or one [K, ..., V_d].
        target_logits: K targets [..., V] (tensors or SparseTargets), or one [K, ..., V]
            tensor, or one SparseTarget with [K, ..., N] fields (rest [K, ...]).
        masks: K bool [...] (or [K, ...]); None = all valid. A masked (position, depth)
            ends the chain there: its α counts as 0 in the products.
        weighting:
            "geometric": Σ_k decay^k · loss_k (EAGLE-3 uses decay 0.8).
            "expected_length": Σ_k w_k · loss_k with per-position detached weights
                w_k = Σ_{j>=k} Π_{i<=j} α_i = ∂E/∂log α_k; with lk_alpha this is exactly −∇E.
            "end_to_end": 1 − (1/K) Σ_j Π_{i<=j} α_i per position, the multi-depth form of TV
                (K = 1 gives 1 − α); only with name="tv".
        decay: the geometric ratio, default 0.8; only with weighting="geometric".
        temperature, top_p, top_k, d2t, mask_out_of_vocab, **params: as in compute_loss,
            applied at every depth. lk_lambda's batch ᾱ is taken per depth.

    Returns:
        loss_sum: 0-dim, Σ over positions and depths of the weighted loss.
        n_valid: 0-dim int64, valid positions at depth 0 (the chains' starts). Every depth
            is divided by this one count, so later depths with fewer valid positions weigh
            less, in line with the chance of reaching them.
        alpha: [K] detached mean α per depth over that depth's valid positions (for logs).
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if weighting == "end_to_end" and name != "tv":
        raise ValueError(
            f"weighting='end_to_end' is the multi-depth TV loss; use name='tv', got {name!r}"
        )
    if decay is not None and weighting != "geometric":
        raise ValueError(f"decay is only used with weighting='geometric', got {weighting!r}")
    check_params(name, params)
    _check_sampling(temperature, top_p, top_k)
    drafts, targets = list(draft_logits), _per_depth(target_logits)
    masks = [None] * len(drafts) if masks is None else list(masks)
    if not len(drafts) == len(targets) == len(masks) > 0:
        raise ValueError(
            f"need the same number (>= 1) of depths for drafts, targets and masks, got "
            f"{len(drafts)}, {len(targets)}, {len(masks)}"
        )
    drafts, targets, masks = _valid_positions(drafts, targets, masks)

    log_alphas, losses, valid = [], [], []
    for draft, target, mask in zip(drafts, targets, masks, strict=True):
        prepared = prepare(
            draft,
            target,
            mask,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            d2t=d2t,
            mask_out_of_vocab=mask_out_of_vocab,
        )
        # α carries gradient only in the end-to-end loss; elsewhere it weights or logs, and
        # the same value comes from one elementwise min instead of a compare and a select.
        if torch.is_grad_enabled() and weighting == "end_to_end":
            log_alpha = log_acceptance(prepared.draft_logp, prepared.target_logp)
        else:
            with torch.no_grad():
                log_alpha = torch.minimum(prepared.draft_logp, prepared.target_logp).logsumexp(-1)
        log_alphas.append(torch.where(prepared.mask, log_alpha, float("-inf")))
        valid.append(prepared.mask)
        if weighting != "end_to_end":
            losses.append(masked_loss(name, prepared, params))

    chain = torch.stack(log_alphas).cumsum(0).exp()  # [K, ...]: Π_{i<=j} α_i
    if weighting == "geometric":
        decay = 0.8 if decay is None else decay
        loss = sum(decay**k * loss_k for k, loss_k in enumerate(losses))
    elif weighting == "expected_length":
        weights = chain.detach().flip(0).cumsum(0).flip(0)  # [K, ...]: Σ_{j>=k} Π_{i<=j} α_i
        loss = sum(w_k * loss_k for w_k, loss_k in zip(weights, losses, strict=True))
    else:
        loss = torch.where(valid[0], 1.0 - chain.mean(0), 0.0)

    with torch.no_grad():
        alpha = torch.stack(
            [la.exp().sum() / v.sum().clamp_min(1) for la, v in zip(log_alphas, valid, strict=True)]
        )
    return loss.sum(), valid[0].sum(), alpha


def _valid_positions(drafts: list, targets: list, masks: list) -> tuple[list, list, list]:
    """The depths' rows at the positions valid at some depth: [..., V] -> [n, V].

    A position masked at every depth adds exactly 0 to the loss, n_valid and α, so its rows
    are dropped before any [position, vocab] work (prompt and padding tokens: often half of
    a chat batch). Depths keep their own masks on the rows left; a mask that is all True
    becomes None. Inputs are returned as they are unless every mask is given and every
    draft, target and mask has the same leading shape.
    """
    shape = drafts[0].shape[:-1]
    for d, t, m in zip(drafts, targets, masks, strict=True):
        t_shape = (t.indices if isinstance(t, SparseTarget) else t).shape[:-1]
        if m is None or not m.shape == d.shape[:-1] == t_shape == shape:
            return drafts, targets, masks  # prepare() checks and explains the shapes
    masks = [m.to(torch.bool) for m in masks]
    keep = torch.stack(masks).any(0)
    if not keep.all():
        drafts = [d[keep] for d in drafts]
        targets = [_rows(t, keep) for t in targets]
        masks = [m[keep] for m in masks]
    return drafts, targets, [None if m.all() else m for m in masks]


def _rows(target: Target, keep: Tensor) -> Target:
    """A target's rows at `keep` (bool over its leading dims)."""
    if isinstance(target, SparseTarget):
        return SparseTarget(*(None if field is None else field[keep] for field in target))
    return target[keep]


def _per_depth(target: Sequence[Target] | Tensor | SparseTarget) -> list[Target]:
    if isinstance(target, SparseTarget):
        rests = [None] * len(target.indices) if target.rest is None else target.rest
        return [
            SparseTarget(i, p, r)
            for i, p, r in zip(target.indices, target.probs, rests, strict=True)
        ]
    return list(target)
