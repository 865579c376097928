"""Loss over K unrolled draft steps (training-time test, docs/theory.md §3 and §4).

Depth k (0-based) holds the draft's k-th step at each position. The chain of acceptances
at a position is α_0, α_1, ...; Π_{i<=j} α_i is the probability that steps 0..j are all
accepted, so the expected number of accepted drafts is E = Σ_j Π_{i<=j} α_i.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from specdistill.losses.api import (
    Prepared,
    SparseTarget,
    Target,
    VocabTarget,
    _check_sampling,
    masked_loss,
    prepare,
)
from specdistill.losses.divergences import log_acceptance
from specdistill.losses.resolved import (
    DepthWeights,
    Sampling,
    TokenLoss,
    depth_weights,
    token_loss,
)


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
    weights = depth_weights(name, weighting, decay)
    loss = token_loss(name, params, mask_out_of_vocab)
    _check_sampling(temperature, top_p, top_k)
    depths = aligned_depths(draft_logits, target_logits, masks)
    return depth_sums(loss, depths, weights, temperature, Sampling(top_p, top_k), d2t)


def aligned_depths(
    draft_logits: Sequence[Tensor] | Tensor,
    target_logits: Sequence[Target] | Tensor | SparseTarget,
    masks: Sequence[Tensor] | Tensor | None,
) -> tuple[list, list, list]:
    """K (draft logits, target, mask) depths as lists, checked to be as many (>= 1)."""
    drafts, targets = list(draft_logits), _per_depth(target_logits)
    masks = [None] * len(drafts) if masks is None else list(masks)
    if not len(drafts) == len(targets) == len(masks) > 0:
        raise ValueError(
            f"need the same number (>= 1) of depths for drafts, targets and masks, got "
            f"{len(drafts)}, {len(targets)}, {len(masks)}"
        )
    return drafts, targets, masks


def depth_sums(
    loss: TokenLoss,
    depths: tuple[list, list, list],
    weights: DepthWeights,
    temperature: float,
    sampling: Sampling,
    d2t: Tensor | None,
    positions: list | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`multi_depth_loss` of a resolved loss on `aligned_depths`, nothing checked again.

    positions: a list that receives, per depth, α at every position (detached, the depth
    mask's shape, 0 where masked): what an acceptance head at the same temperature and
    filters takes as its labels (`losses.acceptance_label`), without computing α again."""
    keep = _kept(*depths)
    drafts, targets, masks = _valid_positions(*depths, keep)
    end_to_end = weights.weighting == "end_to_end"
    log_alphas, losses, valid = [], [], []
    for draft, target, mask in zip(drafts, targets, masks, strict=True):
        prepared = prepare(
            draft,
            target,
            mask,
            temperature=temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            d2t=d2t,
            mask_out_of_vocab=loss.mask_out_of_vocab,
        )
        log_alphas.append(_log_alpha(prepared, with_grad=end_to_end))
        valid.append(prepared.mask)
        if not end_to_end:
            losses.append(masked_loss(loss, prepared))
    chain = torch.stack(log_alphas).cumsum(0).exp()  # [K, ...]: Π_{i<=j} α_i
    total = _weighted(weights, losses, chain, valid[0])
    with torch.no_grad():
        alpha = torch.stack(
            [la.exp().sum() / v.sum().clamp_min(1) for la, v in zip(log_alphas, valid, strict=True)]
        )
        if positions is not None:
            shape = depths[0][0].shape[:-1]
            positions += [_placed(la.exp(), keep, shape) for la in log_alphas]
    return total.sum(), valid[0].sum(), alpha


def _placed(alpha: Tensor, keep: Tensor | None, shape) -> Tensor:
    """α over the rows `_valid_positions` kept -> α at every position of `shape`."""
    if keep is None or bool(keep.all()):
        return alpha.reshape(shape)
    out = alpha.new_zeros(shape)
    out[keep] = alpha
    return out


def _kept(drafts: list, targets: list, masks: list) -> Tensor | None:
    """The positions valid at some depth (bool, the masks' shape); None when a mask is
    missing or the leading shapes differ (nothing is dropped then)."""
    shape = drafts[0].shape[:-1]
    for d, t, m in zip(drafts, targets, masks, strict=True):
        if m is None or not m.shape == d.shape[:-1] == _leading(t).shape[:-1] == shape:
            return None
    return torch.stack([m.to(torch.bool) for m in masks]).any(0)


def _log_alpha(prepared: Prepared, with_grad: bool) -> Tensor:
    """log α per position, −inf where masked. α carries gradient only in the end-to-end
    loss; elsewhere it weighs or logs, and the same value comes from one elementwise min
    instead of a compare and a select."""
    if torch.is_grad_enabled() and with_grad:
        log_alpha = log_acceptance(prepared.draft_logp, prepared.target_logp)
    else:
        with torch.no_grad():
            log_alpha = torch.minimum(prepared.draft_logp, prepared.target_logp).logsumexp(-1)
    return torch.where(prepared.mask, log_alpha, float("-inf"))


def _weighted(weights: DepthWeights, losses: list, chain: Tensor, valid: Tensor) -> Tensor:
    """The depths' per-position losses (or, end to end, their chain of α) weighed into one
    loss per position."""
    if weights.weighting == "geometric":
        return sum(weights.decay**k * loss_k for k, loss_k in enumerate(losses))
    if weights.weighting == "expected_length":
        w = chain.detach().flip(0).cumsum(0).flip(0)  # [K, ...]: Σ_{j>=k} Π_{i<=j} α_i
        return sum(w_k * loss_k for w_k, loss_k in zip(w, losses, strict=True))
    return torch.where(valid, 1.0 - chain.mean(0), 0.0)


def _valid_positions(
    drafts: list, targets: list, masks: list, keep: Tensor | None
) -> tuple[list, list, list]:
    """The depths' rows at the positions valid at some depth (`keep`, from `_kept`):
    [..., V] -> [n, V].

    A position masked at every depth adds exactly 0 to the loss, n_valid and α, so its rows
    are dropped before any [position, vocab] work (prompt and padding tokens: often half of
    a chat batch). Depths keep their own masks on the rows left; a mask that is all True
    becomes None. With `keep` None (a mask missing, or leading shapes that differ) the inputs
    are returned as they are: prepare() checks and explains the shapes.
    """
    if keep is None:
        return drafts, targets, masks
    masks = [m.to(torch.bool) for m in masks]
    if not keep.all():
        drafts = [d[keep] for d in drafts]
        targets = [_rows(t, keep) for t in targets]
        masks = [m[keep] for m in masks]
    return drafts, targets, [None if m.all() else m for m in masks]


def _leading(target: Target) -> Tensor:
    """The tensor whose leading dims are a target's positions."""
    if isinstance(target, SparseTarget):
        return target.indices
    return target.logp if isinstance(target, VocabTarget) else target


def _rows(target: Target, keep: Tensor) -> Target:
    """A target's rows at `keep` (bool over its leading dims)."""
    if isinstance(target, SparseTarget):
        return SparseTarget(*(None if field is None else field[keep] for field in target))
    if isinstance(target, VocabTarget):
        return VocabTarget(target.logp[keep])
    return target[keep]


def _per_depth(target: Sequence[Target] | Tensor | SparseTarget) -> list[Target]:
    if isinstance(target, VocabTarget):
        return [VocabTarget(logp) for logp in target.logp]
    if isinstance(target, SparseTarget):
        rests = [None] * len(target.indices) if target.rest is None else target.rest
        return [
            SparseTarget(i, p, r)
            for i, p, r in zip(target.indices, target.probs, rests, strict=True)
        ]
    return list(target)
