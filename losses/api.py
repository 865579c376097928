"""Loss and acceptance on (draft logits, target) pairs: masking, sampling parameters,
truncated draft vocabulary and sparse targets, done once for every divergence.

Shapes: ``draft_logits: [..., V_d]``; the target is one of
- dense logits ``[..., V]`` (log-probabilities are logits too: pass ``probs.log()`` for a
  target given as probabilities; p = 0 entries become ``-inf``, which is supported);
- a :class:`SparseTarget` (top-N indices and probabilities);
- a :class:`VocabTarget` (log-probabilities already taken over the draft's columns);
and ``mask: [...]`` bool (True = valid). ``V = V_d`` unless ``d2t`` maps the draft
vocabulary into a larger target vocabulary.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from specdistill.losses.divergences import LOG_P_FLOOR, log_acceptance
from specdistill.losses.resolved import TokenLoss, token_loss
from specdistill.losses.rest_bin import check_rest_bin, draft_columns, rest_bins
from specdistill.losses.sampling import check_filters, filter_logits


class SparseTarget(NamedTuple):
    """Target kept as its top-N entries: ``indices: [..., N]`` (int64 target-vocab ids,
    distinct), ``probs: [..., N]``, and optionally ``rest: [...]``, the mass of every other
    token.

    Without ``rest`` the probabilities are renormalised over the N entries, so
    α = Σ min(p, q) is exact for that truncated target. Temperature and top-p/top-k act on
    the N entries only.

    With ``rest`` (docs/theory.md §3, "Sparse targets with a rest bin"), ``probs`` are the
    target's own probabilities of the N tokens (not renormalised; probs and rest together are
    scaled to sum to 1, which absorbs rounding) and both sides are compared on N + 1 bins: the
    N tokens and one rest bin holding p's remaining mass and the draft's mass off the N
    tokens, Σ_{x ∉ top N} q(x). Every loss is then that loss between the two coarsened
    distributions (``ce`` and ``topk_ce`` rank tokens, never the rest bin); α is
    Σ_{top N} min(p, q) + min(p_rest, q_rest), an upper bound of the true α. Only at
    temperature 1, unfiltered: the tail's mass at another temperature or under a filter is
    unknown. With d2t (a draft over V_d) the N tokens are compared in the draft's columns
    and those outside V_d are left out, as a dense target's mass outside V_d is
    (losses/rest_bin.py). Without d2t and with N ≥ V there is no token outside the N and
    ``rest`` is ignored (the N entries are renormalised)."""

    indices: Tensor
    probs: Tensor
    rest: Tensor | None = None


class VocabTarget(NamedTuple):
    """The target's log-probabilities over the draft's own columns, ``logp: [..., V_d]``:
    log-softmax over the whole target vocabulary at temperature 1, then the draft
    vocabulary's entries in the draft's column order, so they sum to the target's mass on
    V_d. Exactly the target side the live target gives a draft over V_d (with d2t), stored
    once (train/target_cache.py) so that training needs no target forward and no
    full-vocabulary softmax. The columns are the draft's already (a d2t passed with it is
    not used). Only at temperature 1, unfiltered, and not at temperature 0: the tokens
    outside V_d are not there to filter, rescale or take the argmax of."""

    logp: Tensor


Target = Tensor | SparseTarget | VocabTarget


class Prepared(NamedTuple):
    """Inputs of a divergence: ``draft_logp, target_logp: [..., V_d]``, ``mask: [...]``.

    target_logp is the raw target on the draft vocabulary: with d2t it sums to the target's
    mass on V_d (< 1). Masked rows of both hold finite placeholders. ``rest_bin``: the last
    dim is instead the N + 1 bins of a SparseTarget with ``rest`` (the N tokens, then the
    rest bin; both sides sum to 1)."""

    draft_logp: Tensor
    target_logp: Tensor
    mask: Tensor
    rest_bin: bool = False


def compute_loss(
    name: str,
    draft_logits: Tensor,
    target_logits: Target,
    mask: Tensor | None = None,
    *,
    temperature: float = 1.0,
    top_p: float | None = None,
    top_k: int | None = None,
    d2t: Tensor | None = None,
    mask_out_of_vocab: bool = False,
    **params,
) -> tuple[Tensor, Tensor]:
    """Summed per-position loss over the valid positions.

    Args:
        name: a key of ``LOSSES`` (fkl, rkl, jsd, tv, lk_alpha, lk_lambda, ce, topk_ce, mix).
        draft_logits: [..., V_d], any float dtype; computed in fp32 (fp64 stays fp64).
        target_logits: [..., V] logits or a SparseTarget; treated as constant (detached).
        mask: [...] bool, True = valid; None = all valid. Masked positions contribute
            exactly 0 whatever their logits (NaN included).
        temperature: > 0, applied to both sides (logits / T).
        top_p, top_k: filter the target (after temperature) as the verifier does at serving
            (`losses.sampling.filter_logits`; None = off). The draft is left unfiltered:
            its own filter is not differentiable, and KL-style losses would be infinite
            wherever p has mass outside the draft's nucleus (docs/theory.md §1).
        d2t: [V_d] int64, target_id = i + d2t[i] for a draft over a truncated vocabulary.
            α-style losses use the raw target p on V_d (the true acceptance); KL-style
            losses use p renormalised over V_d.
        mask_out_of_vocab: with d2t, also mask positions whose target argmax is not in V_d.
        **params: the loss's own params (``eta``, ``lambda_mode``, ``beta``, ``k``, ``parts``),
            as its declaration gives them (`losses.divergences.DECLARED`).

    Returns:
        loss_sum: 0-dim fp32 tensor with grad to draft_logits.
        n_valid: 0-dim int64 tensor, the number of valid positions (after
            mask_out_of_vocab). Divide once by the global count: loss_sum / n_valid.
    """
    loss = token_loss(name, params, mask_out_of_vocab)
    _check_sampling(temperature, top_p, top_k)
    prepared = prepare(
        draft_logits,
        target_logits,
        mask,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        d2t=d2t,
        mask_out_of_vocab=mask_out_of_vocab,
    )
    return masked_loss(loss, prepared).sum(), prepared.mask.sum()


def acceptance(
    draft_logits: Tensor,
    target_logits: Target,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    *,
    top_p: float | None = None,
    top_k: int | None = None,
    d2t: Tensor | None = None,
) -> Tensor:
    """Acceptance probability α per position: [..., V_d], [..., V] -> [...] (fp32, fp64
    for fp64 draft logits).

    α = Σ_x min(p(x), q(x)) at ``temperature`` (target filtered by top_p/top_k, raw target
    mass on V_d with d2t, as in :func:`compute_loss`). Temperature 0 gives greedy agreement:
    1.0 if argmax q = argmax p else 0.0 (filters do not move the argmax). Masked positions
    give 0, and so do positions whose draft logits hold a NaN or +inf (a diverged draft
    accepts nothing; at temperature 0 also all −inf rows). Differentiable for temperature > 0.
    """
    if temperature == 0:
        _check_sampling(1.0, top_p, top_k)
        if isinstance(target_logits, VocabTarget):
            raise ValueError(_VOCAB_TARGET_ONLY)
        draft_ids = _draft_ids(d2t, draft_logits.shape[-1])
        vocab_size = _target_vocab(target_logits, draft_logits.shape[-1], draft_ids)
        target = target_logp(
            target_logits, mask, temperature=1.0, dtype=_dtype(draft_logits), vocab_size=vocab_size
        )
        draft_argmax = _valid_rows(draft_logits, mask).argmax(-1)
        if draft_ids is not None:
            draft_argmax = draft_ids[draft_argmax]
        agree = (draft_argmax == target.argmax(-1)) & ~_diverged_rows(draft_logits)
        alpha = agree.to(_dtype(draft_logits))
    else:
        _check_sampling(temperature, top_p, top_k)
        prepared = prepare(
            draft_logits,
            target_logits,
            mask,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            d2t=d2t,
            mask_out_of_vocab=False,
        )
        alpha = log_acceptance(prepared.draft_logp, prepared.target_logp).exp()
        alpha = torch.where(alpha.isnan(), 0.0, alpha)  # NaN from a non-finite draft
    return alpha if mask is None else torch.where(mask, alpha, 0.0)


def _diverged_rows(draft_logits: Tensor) -> Tensor:
    """Positions whose draft logits hold a NaN or +inf, or are all −inf: [..., V] -> [...]
    bool. Their argmax is the NaN's (or the infinity's, or the first) index, not a
    prediction. amax is NaN if any entry is, +inf if any is, −inf if all are."""
    return ~torch.isfinite(draft_logits.detach().amax(-1))


def masked_loss(loss: TokenLoss, prepared: Prepared, alpha_bar: Tensor | None = None) -> Tensor:
    """Per-position loss [...] with exactly 0 at masked positions.

    A part that takes the batch's mean α (lk_lambda in batch mode without its own
    ``alpha_bar``) gets `alpha_bar`, else the mean α over the valid positions given here (0
    when none are valid).
    """
    if loss.batch_alpha and alpha_bar is None:
        alpha_bar = alpha_sum_of(prepared) / prepared.mask.sum().clamp_min(1)
    value = loss.per_position(
        prepared.draft_logp, prepared.target_logp, prepared.rest_bin, alpha_bar
    )
    return torch.where(prepared.mask, value, 0.0)


def alpha_sum_of(prepared: Prepared) -> Tensor:
    """Σ α over the valid positions, detached: 0-dim."""
    with torch.no_grad():
        alpha = torch.minimum(prepared.draft_logp, prepared.target_logp).exp_().sum(-1)
        return torch.where(prepared.mask, alpha, 0.0).sum()


def prepare(
    draft_logits: Tensor,
    target: Target,
    mask: Tensor | None,
    *,
    temperature: float,
    top_p: float | None,
    top_k: int | None,
    d2t: Tensor | None,
    mask_out_of_vocab: bool,
) -> Prepared:
    """Log-probabilities of both sides on the draft vocabulary, and the final mask.

    draft_logits: [..., V_d]; target: [..., V], a SparseTarget or a VocabTarget [..., V_d];
    mask: [...] or None.
    Raises ValueError for non-finite target logits at valid positions, and (with d2t) for
    valid positions where the target has no mass on the draft vocabulary.
    """
    vocab_size = draft_logits.shape[-1]
    draft_ids = _draft_ids(d2t, vocab_size)
    if mask_out_of_vocab and d2t is None:
        raise ValueError("mask_out_of_vocab needs d2t (the draft-to-target vocabulary map)")
    mask, full_mask = _masks(draft_logits, mask)
    dtype = _dtype(draft_logits)
    if isinstance(target, VocabTarget):
        if temperature != 1.0 or top_p is not None or top_k is not None or mask_out_of_vocab:
            raise ValueError(_VOCAB_TARGET_ONLY)
        return _prepare_vocab_target(draft_logits, target, mask, full_mask, dtype)
    if isinstance(target, SparseTarget) and target.rest is not None:
        check_rest_bin(temperature, top_p, top_k)
        if target.indices.shape[-1] < vocab_size or draft_ids is not None:
            return _prepare_rest_bin(draft_logits, target, mask, full_mask, dtype, draft_ids)
        target = SparseTarget(target.indices, target.probs)  # N = V: no token outside them
    target = target_logp(
        target,
        full_mask,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        dtype=dtype,
        vocab_size=_target_vocab(target, vocab_size, draft_ids),
    )
    if target.shape[:-1] != draft_logits.shape[:-1]:
        raise ValueError(
            f"target shape {list(target.shape)} and draft_logits shape "
            f"{list(draft_logits.shape)} must agree on all but the last dim"
        )
    if draft_ids is not None:
        in_draft_vocab = torch.zeros(target.shape[-1], dtype=torch.bool, device=target.device)
        in_draft_vocab[draft_ids] = True
        if mask_out_of_vocab:
            mask = mask & in_draft_vocab[target.argmax(-1)]
        target = target.index_select(-1, draft_ids)
        no_mass = mask & (target.amax(-1) < LOG_P_FLOOR)
        if no_mass.any():
            raise ValueError(
                f"target has no probability mass (max p < 1e-38) on the draft vocabulary at "
                f"{int(no_mass.sum())} valid positions; mask them (mask_out_of_vocab=True)"
            )
    elif target.shape[-1] != vocab_size:
        raise ValueError(
            f"target vocab {target.shape[-1]} != draft vocab {vocab_size}; pass d2t to map a "
            "truncated draft vocabulary into the target's"
        )
    draft = _valid_rows(draft_logits, full_mask).to(dtype)
    if temperature != 1.0:
        draft = draft / temperature
    draft_logp = draft.log_softmax(-1)
    return Prepared(draft_logp, target, mask)


_VOCAB_TARGET_ONLY = (
    "a VocabTarget holds the target's log-probabilities at temperature 1 on the draft's "
    "columns only: use it at temperature 1, without top_p / top_k or mask_out_of_vocab "
    "(the tokens outside the draft vocabulary are not stored)"
)


def _prepare_vocab_target(
    draft_logits: Tensor, target: VocabTarget, mask: Tensor, full_mask: Tensor | None, dtype
) -> Prepared:
    """`prepare` of a VocabTarget: its log-probabilities as they are (masked rows 0). A d2t
    given with it is the draft's map, which its columns follow already: not used."""
    logp = target.logp.detach().to(dtype)
    if logp.shape != draft_logits.shape:
        raise ValueError(
            f"VocabTarget shape {list(logp.shape)} must equal draft_logits shape "
            f"{list(draft_logits.shape)}"
        )
    row_max = logp.amax(-1)
    bad = (row_max.isnan() | (row_max > 0) | (row_max < LOG_P_FLOOR)) & mask
    if bad.any():
        raise ValueError(
            f"VocabTarget log-probabilities are NaN, above 0 or carry no mass on the draft "
            f"vocabulary at {int(bad.sum())} valid positions"
        )
    if full_mask is not None:  # finite placeholders in masked rows, whatever they held
        logp = logp.masked_fill(~full_mask[..., None], 0.0)
    draft_logp = _valid_rows(draft_logits, full_mask).to(dtype).log_softmax(-1)
    return Prepared(draft_logp, logp, mask)


def _masks(draft_logits: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """(the mask, all True when None; the mask as given, None when None), checked."""
    if mask is None:
        mask = torch.ones(draft_logits.shape[:-1], dtype=torch.bool, device=draft_logits.device)
        full_mask = None
    else:
        full_mask = mask = mask.to(torch.bool)
    if mask.shape != draft_logits.shape[:-1]:
        raise ValueError(
            f"mask shape {list(mask.shape)} must equal draft_logits.shape[:-1] "
            f"= {list(draft_logits.shape[:-1])}"
        )
    return mask, full_mask


def target_logp(
    target: Target,
    mask: Tensor | None,
    *,
    temperature: float,
    dtype: torch.dtype,
    top_p: float | None = None,
    top_k: int | None = None,
    vocab_size: int | None = None,
) -> Tensor:
    """Processed target log-probabilities over the target vocabulary, detached:
    [..., V] (or SparseTarget, scattered into ``vocab_size``) -> [..., V].

    Filtered by `losses.sampling.filter_logits` (temperature, top-k, top-p), then renormalised.
    """
    if isinstance(target, SparseTarget):
        logits = _dense(target, mask, vocab_size, dtype)
    else:
        logits = target.detach().to(dtype)
    row_max = logits.amax(-1)  # NaN if any NaN, +inf if any +inf, -inf if all -inf
    bad = ~torch.isfinite(row_max)
    if mask is not None:
        bad &= mask
    if bad.any():
        raise ValueError(
            f"target logits are non-finite at {int(bad.sum())} valid positions (NaN, +inf, "
            "or every entry -inf); fix the target or mask those positions"
        )
    target_logp = filter_logits(logits, temperature, top_p, top_k).log_softmax(-1)
    if mask is not None:  # finite placeholders in masked rows, whatever they held
        target_logp.masked_fill_(~mask[..., None], 0.0)
    return target_logp


def _prepare_rest_bin(
    draft_logits: Tensor,
    target: SparseTarget,
    mask: Tensor,
    full_mask: Tensor | None,
    dtype: torch.dtype,
    draft_ids: Tensor | None,
) -> Prepared:
    """Both sides on N + 1 bins (the N tokens, then the rest bin): [..., V] -> [..., N + 1]
    (losses/rest_bin.py). With `draft_ids` (a draft over V_d) the N target ids become draft
    columns; the stored tokens outside V_d leave empty slots, their mass uncompared."""
    lead, vocab_size = draft_logits.shape[:-1], draft_logits.shape[-1]
    indices, probs, rest = target.indices, target.probs.detach().to(dtype), target.rest
    if indices.shape != probs.shape or indices.shape[:-1] != lead or rest.shape != lead:
        raise ValueError(
            f"SparseTarget indices {list(indices.shape)}, probs {list(probs.shape)} and rest "
            f"{list(rest.shape)} must be [..., N], [..., N] and [...] with [...] = "
            f"draft_logits.shape[:-1] = {list(lead)}"
        )
    if full_mask is not None:  # masked rows may hold any index
        indices = torch.where(full_mask[..., None], indices, 0)
    rest = rest.detach().to(dtype)
    total = probs.sum(-1) + rest
    if draft_ids is None:
        out_of_range = mask & ((indices < 0) | (indices >= vocab_size)).any(-1)
        what = f"the vocabulary [0, {vocab_size})"
    else:
        out_of_range = mask & (indices < 0).any(-1)
        what = "the target's vocabulary (negative)"
        indices, probs = draft_columns(indices, probs, draft_ids)
        # a row whose stored tokens all lie outside V_d and leave no rest: all its mass is
        # uncompared; the rest bin keeps a floor so that p on the N + 1 bins is not all 0
        tiny = torch.finfo(dtype).tiny
        rest = torch.where(probs.sum(-1) + rest > 0, rest, tiny)
    if out_of_range.any():
        raise ValueError(
            f"SparseTarget indices outside {what} at {int(out_of_range.sum())} valid positions"
        )
    bad = mask & ~((probs >= 0).all(-1) & (rest >= 0) & torch.isfinite(total) & (total > 0))
    if bad.any():
        raise ValueError(
            f"SparseTarget probs and rest must be finite, >= 0 and not all 0; they are not at "
            f"{int(bad.sum())} valid positions"
        )
    draft_logp = _valid_rows(draft_logits, full_mask).to(dtype).log_softmax(-1)
    draft_bins, target_logp = rest_bins(draft_logp, indices, probs, rest, total, mask)
    return Prepared(draft_bins, target_logp, mask, rest_bin=True)


def _dense(target: SparseTarget, mask: Tensor | None, vocab_size: int, dtype) -> Tensor:
    """SparseTarget -> dense log-probability logits [..., vocab_size], −inf off the top N."""
    indices, probs = target.indices, target.probs.detach().to(dtype)
    if mask is not None:  # masked rows may hold any index
        indices = torch.where(mask[..., None], indices, 0)
    dense = probs.new_full((*probs.shape[:-1], vocab_size), float("-inf"))
    return dense.scatter(-1, indices, probs.log())


def _draft_ids(d2t: Tensor | None, vocab_size: int) -> Tensor | None:
    """Target-vocab id of each draft token, [V_d] (target_id = i + d2t[i]); None without d2t."""
    if d2t is None:
        return None
    if d2t.shape != (vocab_size,):
        raise ValueError(f"d2t must have shape [V_d]=[{vocab_size}], got {list(d2t.shape)}")
    return torch.arange(vocab_size, device=d2t.device) + d2t


def _target_vocab(target: Target, draft_vocab: int, draft_ids: Tensor | None) -> int | None:
    """Size of the dense vocabulary a SparseTarget is scattered into (None for dense)."""
    if not isinstance(target, SparseTarget):
        return None
    if draft_ids is None:
        return draft_vocab
    return int(torch.maximum(draft_ids.max(), target.indices.max())) + 1


def _valid_rows(x: Tensor, mask: Tensor | None) -> Tensor:
    """Zero the rows of masked positions, so NaN/inf there cannot reach the gradient.
    Values there are dropped by the final torch.where, so without grad x is returned as is."""
    if mask is None or not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return torch.where(mask[..., None], x, 0)


def _dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _check_sampling(temperature: float, top_p: float | None, top_k: int | None) -> None:
    if not temperature > 0:
        raise ValueError(
            f"temperature must be > 0 for losses, got {temperature} "
            "(temperature 0 only exists for acceptance(), as greedy agreement)"
        )
    check_filters(top_p, top_k)
