"""The accepted-length loss (``loss.name: tau``) on logits or hidden states: the target's
processing (temperature, top-p / top-k) as every loss has it (`losses.api.prepare`), then the
chain math of `losses.chain` (docs/theory.md, "The accepted-length objective").

Inputs are N chains of γ positions: ``draft_logits: [N, γ, V]`` (or hidden states and the
LM head), the target's ``[N, γ, V]`` logits (or hidden states and head), ``tokens: [N, γ−1]``
the draft's samples at ``temperature`` and ``mask: [N]``. Both functions return
`TauSums`: Σ over valid chains of 1 − L/γ (its gradient the estimator's), their number,
Σ L and Σ α at the chains' first positions (detached, for logs).
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from specdistill.losses.api import Target, _check_sampling, prepare
from specdistill.losses.chain import (
    RowTerms,
    chain_weights,
    log_alpha_of,
    row_terms,
    weighted_terms,
    with_surrogate_grad,
)
from specdistill.losses.chunked import chunked_rows_loss


class TauSums(NamedTuple):
    """Sums over the valid chains: ``loss_sum`` (Σ 1 − L/γ, with the estimator's gradient),
    ``n_chains`` (int64), ``length_sum`` (Σ L) and ``alpha_sum`` (Σ α at each chain's first
    position, the teacher-forced α at its prefix), the last two detached."""

    loss_sum: Tensor
    n_chains: Tensor
    length_sum: Tensor
    alpha_sum: Tensor


def tau_loss(
    draft_logits: Tensor,
    target_logits: Tensor,
    tokens: Tensor,
    mask: Tensor | None = None,
    *,
    temperature: float = 1.0,
    top_p: float | None = None,
    top_k: int | None = None,
    estimator: str = "score",
    d2t: Tensor | None = None,
) -> TauSums:
    """Accepted-length loss of N chains from their logits (module docstring). With `d2t`
    (an EAGLE-3 head's map), the draft's logits and `tokens` are over its reduced
    vocabulary and the target's are compared on those tokens only."""
    _check_sampling(temperature, top_p, top_k)
    rows = _row_mask(mask, draft_logits.shape[:2], draft_logits.device)
    prepared = prepare(
        draft_logits,
        target_logits,
        rows,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        d2t=d2t,
        mask_out_of_vocab=False,
    )
    terms = row_terms(prepared.draft_logp, prepared.target_logp, tokens)
    return _sums(terms, mask, estimator, draft_logits.shape[1])


def chunked_tau_loss(
    draft_hidden: Tensor,
    draft_head_weight: Tensor,
    target: Target | tuple[Tensor, Tensor],
    tokens: Tensor,
    mask: Tensor | None = None,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    top_p: float | None = None,
    top_k: int | None = None,
    estimator: str = "score",
) -> TauSums:
    """`tau_loss` from hidden states ``[N, γ, H]`` and the LM head ``[V, H]``, with the same
    values and gradients and O(chunk_size × V) extra memory: a no-grad pass over chunks of
    rows computes the per-position terms' values, hence the estimator's weights; a second
    pass (losses/chunked.py) computes the weighted terms and their gradients. ``target``:
    ``[N, γ, V]`` logits or ``(target_hidden [N, γ, H_t], target_head_weight [V, H_t])``."""
    _check_sampling(temperature, top_p, top_k)
    n, gamma = draft_hidden.shape[:2]
    if gamma < 1 or tokens.shape != (n, gamma - 1):
        raise ValueError(
            f"tau: tokens must be [chains, gamma - 1] = [{n}, {gamma - 1}], got "
            f"{list(tokens.shape)}"
        )
    rows = _ChainRows.of(draft_hidden, target, tokens, mask, (temperature, top_p, top_k))
    hidden = draft_hidden.reshape(n * gamma, -1)
    chunks = [slice(s, s + chunk_size) for s in range(0, n * gamma, max(chunk_size, 1))]
    with torch.no_grad():
        values = [rows.terms(r, hidden[r] @ draft_head_weight.T) for r in chunks]
    log_alpha, log_r, log_q = (torch.cat(v).reshape(n, gamma) for v in zip(*values, strict=True))
    terms = RowTerms(log_alpha, log_r[:, :-1], log_q[:, :-1])
    weights = chain_weights(terms.log_r, terms.log_alpha, mask, estimator)
    flat = _flat_weights(weights)

    def chunk_loss(r: slice, logits: Tensor) -> Tensor:
        la, lr, lq = rows.terms(r, logits)
        w = type(weights)(*(weight[r, None] for weight in flat), None)
        return -weighted_terms(RowTerms(la[:, None], lr[:, None], lq[:, None]), w).sum() / gamma

    surrogate = chunked_rows_loss(hidden, draft_head_weight, chunk_size, chunk_loss)
    valid = _valid(mask, n, hidden.device)
    value = (1.0 - weights.length / gamma)[valid].sum()
    return TauSums(
        with_surrogate_grad(value, surrogate),
        valid.sum(),
        weights.length.sum(),
        weights.alpha[:, 0].sum(),
    )


@dataclass(frozen=True)
class _ChainRows:
    """N chains of γ positions as N·γ rows: each row's sampled token (0 at a chain's last
    position, whose token is never needed), its chain's mask, the target's rows, and the
    target's processing (temperature, top_p, top_k)."""

    tokens: Tensor
    mask: Tensor
    target: Tensor | tuple[Tensor, Tensor]
    sampling: tuple[float, float | None, int | None]

    @classmethod
    def of(cls, draft_hidden, target, tokens, mask, sampling) -> "_ChainRows":
        n, gamma = draft_hidden.shape[:2]
        flat_tokens = torch.cat([tokens, tokens.new_zeros(n, 1)], 1).reshape(-1).long()
        rows_mask = _row_mask(mask, (n, gamma), draft_hidden.device).reshape(-1)
        if isinstance(target, tuple):
            flat_target = (target[0].detach().reshape(n * gamma, -1), target[1].detach())
        else:
            flat_target = target.detach().reshape(n * gamma, -1)
        return cls(flat_tokens, rows_mask, flat_target, sampling)

    def terms(self, rows: slice, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(log α, log r, log q) of `rows` from the draft's logits there: [n] each."""
        if isinstance(self.target, tuple):
            t_hidden, t_head = self.target
            t_logits = t_hidden[rows] @ t_head.T
        else:
            t_logits = self.target[rows]
        temperature, top_p, top_k = self.sampling
        p = prepare(
            logits,
            t_logits,
            self.mask[rows],
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            d2t=None,
            mask_out_of_vocab=False,
        )
        index = self.tokens[rows, None]
        log_q = p.draft_logp.gather(-1, index).squeeze(-1)
        log_r = torch.clamp_max(p.target_logp.gather(-1, index).squeeze(-1) - log_q, 0.0)
        return log_alpha_of(p.draft_logp, p.target_logp), log_r, log_q


def _flat_weights(weights) -> tuple[Tensor, Tensor, Tensor]:
    """The chain weights of α, r and q as one weight per row [N·γ] (0 where a chain's last
    position has no r or q term)."""
    pad = torch.zeros_like(weights.alpha[:, :1])
    return (
        weights.alpha.reshape(-1),
        torch.cat([weights.r, pad], 1).reshape(-1),
        torch.cat([weights.q, pad], 1).reshape(-1),
    )


def _sums(terms: RowTerms, mask: Tensor | None, estimator: str, gamma: int):
    weights = chain_weights(terms.log_r, terms.log_alpha, mask, estimator)
    surrogate = -weighted_terms(terms, weights).sum() / gamma
    valid = _valid(mask, weights.length.shape[0], weights.length.device)
    value = (1.0 - weights.length / gamma)[valid].sum()
    return TauSums(
        with_surrogate_grad(value, surrogate),
        valid.sum(),
        weights.length.sum(),
        weights.alpha[:, 0].sum(),
    )


def _valid(mask: Tensor | None, n: int, device) -> Tensor:
    return torch.ones(n, dtype=torch.bool, device=device) if mask is None else mask.bool()


def _row_mask(mask: Tensor | None, shape, device) -> Tensor:
    """A chain's mask on each of its γ positions: [N] -> [N, γ]."""
    return _valid(mask, shape[0], device)[:, None].expand(*shape)
