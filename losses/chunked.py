"""Memory-bounded loss from the draft's hidden states and LM head, chunk by chunk.

The [positions, vocab] logits never exist whole: each chunk of positions computes its
logits, its loss and that loss's gradient, and frees them. The gradients with respect to
the hidden states and the head weight are computed during the forward pass (one
``autograd.grad`` per chunk) and kept, at the size of those inputs; backward only scales
them. This does the work of one forward and one backward, with no recomputation, and
extra memory O(chunk_size × vocab) instead of O(positions × vocab). (Recomputing each
chunk in backward, e.g. torch.utils.checkpoint, would also bound memory but redo the
forward: ~1.3× the matmul work.) The gradient buffers make backward single-order: no
double backward through this loss.
"""

import torch
from torch import Tensor

from specdistill.losses.api import (
    SparseTarget,
    Target,
    _check_sampling,
    alpha_sum_of,
    masked_loss,
    prepare,
)
from specdistill.losses.resolved import Sampling, TokenLoss, token_loss


def chunked_loss(
    name: str,
    draft_hidden: Tensor,
    draft_head_weight: Tensor,
    target_logits: Target | tuple[Tensor, Tensor],
    mask: Tensor | None = None,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    top_p: float | None = None,
    top_k: int | None = None,
    d2t: Tensor | None = None,
    mask_out_of_vocab: bool = False,
    return_alpha: bool = False,
    **params,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """``compute_loss(name, draft_hidden @ draft_head_weight.T, target, mask, ...)``, with
    the same values and gradients, O(chunk_size × vocab) extra memory.

    Args:
        draft_hidden: [..., H] (e.g. [N, H] or [B, S, H]).
        draft_head_weight: [V_d, H], the draft's LM head (no bias).
        target_logits: [..., V] logits, a SparseTarget with [..., N] fields (rest [...]), or
            ``(target_hidden [..., H_t], target_head_weight [V, H_t])``, whose logits are
            then also computed per chunk. Treated as constant.
        mask: [...] bool, True = valid; None = all valid.
        chunk_size: positions per chunk; lk_lambda's temporaries take about ten
            [chunk_size, V] fp32 buffers at once.
        temperature, top_p, top_k, d2t, mask_out_of_vocab, **params: as in compute_loss.
            For lk_lambda's batch ᾱ, a first no-grad pass over the chunks computes ᾱ over
            all valid positions, so the value matches the direct computation.

        return_alpha: also return Σ α over the valid positions (detached), taken from the
            chunks the loss computes anyway (no second pass over the vocabulary).

    Returns:
        (loss_sum, n_valid) as compute_loss: 0-dim fp32 (grad to draft_hidden and
        draft_head_weight), 0-dim int64; with return_alpha, (loss_sum, n_valid, alpha_sum).
    """
    loss = token_loss(name, params, mask_out_of_vocab)
    _check_sampling(temperature, top_p, top_k)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return chunked_sums(
        loss,
        draft_hidden,
        draft_head_weight,
        target_logits,
        mask,
        chunk_size=chunk_size,
        temperature=temperature,
        sampling=Sampling(top_p, top_k),
        d2t=d2t,
        return_alpha=return_alpha,
    )


def chunked_sums(
    loss: TokenLoss,
    draft_hidden: Tensor,
    draft_head_weight: Tensor,
    target_logits: Target | tuple[Tensor, Tensor],
    mask: Tensor | None,
    *,
    chunk_size: int,
    temperature: float,
    sampling: Sampling,
    d2t: Tensor | None,
    return_alpha: bool,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """`chunked_loss` of a resolved loss, nothing checked again."""
    hidden, flat_target, mask = _flat_rows(draft_hidden, target_logits, mask)

    def prepare_chunk(rows: slice, draft_logits: Tensor):
        return prepare(
            draft_logits,
            _target_rows(flat_target, rows),
            None if mask is None else mask[rows],
            temperature=temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            d2t=d2t,
            mask_out_of_vocab=loss.mask_out_of_vocab,
        )

    chunks = [slice(s, s + chunk_size) for s in range(0, hidden.shape[0], chunk_size)]
    alpha_bar = None
    if loss.batch_alpha:
        alpha_bar = _alpha_bar(hidden, draft_head_weight, chunks, prepare_chunk)
    alphas = []

    def chunk_loss(rows: slice, draft_logits: Tensor) -> tuple[Tensor, Tensor]:
        prepared = prepare_chunk(rows, draft_logits)
        if return_alpha:
            alphas.append(alpha_sum_of(prepared))
        return masked_loss(loss, prepared, alpha_bar).sum(), prepared.mask.sum()

    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or draft_head_weight.requires_grad
    )
    loss_sum, n_valid = _ChunkedHeadLoss.apply(
        hidden, draft_head_weight, chunks, chunk_loss, needs_grad
    )
    if not return_alpha:
        return loss_sum, n_valid
    alpha_sum = torch.stack(alphas).sum() if alphas else torch.zeros((), device=hidden.device)
    return loss_sum, n_valid, alpha_sum


def _flat_rows(draft_hidden: Tensor, target: Target | tuple[Tensor, Tensor], mask):
    """(hidden [N, H], target, mask [N] or None) with the leading dims flattened into rows
    and the masked rows dropped: they add exactly 0 to the loss and its gradients, so they
    go before any logits exist (prompt and padding tokens: often half of a chat batch)."""
    lead = draft_hidden.shape[:-1]
    hidden = draft_hidden.reshape(-1, draft_hidden.shape[-1])
    if mask is not None:
        if mask.shape != lead:
            raise ValueError(f"mask shape {list(mask.shape)} must equal {list(lead)}")
        mask = mask.reshape(-1)
    target = _flat_target(target, lead)
    if mask is not None and not mask.all():
        return hidden[mask], _keep_rows(target, mask), None
    return hidden, target, mask


def _alpha_bar(hidden: Tensor, head: Tensor, chunks: list[slice], prepare_chunk) -> Tensor:
    """lk_lambda's batch ᾱ over every valid row, from a first no-grad pass over the chunks."""
    alpha_sum, count = 0.0, 0
    with torch.no_grad():
        for rows in chunks:
            prepared = prepare_chunk(rows, hidden[rows] @ head.T)
            alpha_sum = alpha_sum + alpha_sum_of(prepared)
            count = count + prepared.mask.sum()
    return alpha_sum / max(int(count), 1)


def chunked_rows_loss(hidden: Tensor, weight: Tensor, chunk_size: int, chunk_loss) -> Tensor:
    """Σ_chunks chunk_loss(rows, hidden[rows] @ weight.T) with the memory bound of
    `chunked_loss`: hidden [N, H], weight [V, H]; ``chunk_loss(rows: slice, logits) -> 0-dim``
    (any per-row loss whose weights are fixed beforehand, e.g. losses/tau.py's second pass).
    Returns the 0-dim sum, differentiable to hidden and weight (single-order)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    chunks = [slice(s, s + chunk_size) for s in range(0, hidden.shape[0], chunk_size)]
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)

    def with_count(rows: slice, logits: Tensor) -> tuple[Tensor, Tensor]:
        return chunk_loss(rows, logits), torch.zeros((), dtype=torch.int64, device=logits.device)

    loss_sum, _ = _ChunkedHeadLoss.apply(hidden, weight, chunks, with_count, needs_grad)
    return loss_sum


class _ChunkedHeadLoss(torch.autograd.Function):
    """loss_sum = Σ_chunks chunk_loss(rows, hidden[rows] @ weight.T); grads computed in
    forward. hidden: [N, H], weight: [V, H] -> (loss_sum 0-dim, n_valid 0-dim int64)."""

    @staticmethod
    def forward(ctx, hidden, weight, chunks, chunk_loss, needs_grad):
        need_hidden = needs_grad and hidden.requires_grad
        need_weight = needs_grad and weight.requires_grad
        hidden, weight = hidden.detach(), weight.detach()
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        accumulate = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros_like(weight, dtype=accumulate) if need_weight else None
        loss_sum = torch.zeros((), dtype=accumulate, device=hidden.device)
        n_valid = torch.zeros((), dtype=torch.int64, device=hidden.device)
        for rows in chunks:
            logits = (hidden[rows] @ weight.T).requires_grad_(needs_grad)
            with torch.set_grad_enabled(needs_grad):
                loss, n = chunk_loss(rows, logits)
            if needs_grad:
                (grad_logits,) = torch.autograd.grad(loss, logits)
                if need_hidden:
                    grad_hidden[rows] = grad_logits @ weight
                if need_weight:
                    grad_weight.addmm_(grad_logits.T.to(accumulate), hidden[rows].to(accumulate))
            loss_sum += loss.detach()
            n_valid += n
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(n_valid)
        return loss_sum, n_valid

    @staticmethod
    def backward(ctx, grad_loss, _grad_n_valid):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None


def _flat_target(target: Target | tuple[Tensor, Tensor], lead: torch.Size):
    """Target with its leading dims flattened to one: rows line up with the hidden rows."""
    n = len(lead)
    if isinstance(target, SparseTarget):
        rest = None if target.rest is None else target.rest.flatten(0, n - 1)
        return SparseTarget(target.indices.flatten(0, n - 1), target.probs.flatten(0, n - 1), rest)
    if isinstance(target, tuple):
        target_hidden, target_head_weight = target
        return target_hidden.detach().flatten(0, n - 1), target_head_weight.detach()
    return target.flatten(0, n - 1)


def _keep_rows(target, keep: Tensor):
    """A flat target's rows at `keep` ([N] bool), in its own form: a (hidden, head) pair
    keeps its hidden rows (no logits yet)."""
    if isinstance(target, SparseTarget):
        return SparseTarget(*(None if field is None else field[keep] for field in target))
    if isinstance(target, tuple):
        target_hidden, target_head_weight = target
        return target_hidden[keep], target_head_weight
    return target[keep]


def _target_rows(target, rows: slice) -> Target:
    if isinstance(target, SparseTarget):
        rest = None if target.rest is None else target.rest[rows]
        return SparseTarget(target.indices[rows], target.probs[rows], rest)
    if isinstance(target, tuple):
        target_hidden, target_head_weight = target
        return target_hidden[rows] @ target_head_weight.T
    return target[rows]
