"""The accepted length of a draft's own chain, and the gradient estimator that maximises it
(docs/theory.md, "The accepted-length objective").

A chain is γ draft positions from one prefix: the draft sampled a_1 … a_{γ−1} (a_γ is never
needed), the target scored the γ positions. Under speculative sampling the expected number
of accepted draft tokens of the round is

    L(a) = Σ_{k=1..γ} (Π_{j<k} r_j) · α_k,   r_j = min(1, p_j(a_j) / q_j(a_j)),
                                              α_k = Σ_x min(p_k(x), q_k(x)),

in expectation over a ~ q (the last factor taken in expectation over a_k). Π_k α_k is not
this quantity.

The gradient of J = E_{a~q}[L(a)] has a pathwise part (through r_j and α_k with the tokens
fixed) and a score-function part (the chain's own distribution depends on q). With
c_k = (Π_{j<k} r_j) α_k and G_k = Σ_{m>k} c_m (what follows a_k):

    ∇J = E[ Σ_k c_k ∇log α_k + Σ_{k<γ} G_k ∇log r_k + Σ_{k<γ} (G_k − b_k) ∇log q_k(a_k) ],

where b_k, a baseline that does not depend on a_k or later tokens, keeps the estimate
unbiased. Where r_k < 1 the pathwise term carries −G_k ∇log q_k(a_k), so a_k's score has
the coefficient G_k·1[r_k = 1] − b_k in all; b_k is the mean G_k·1[r_k = 1] of the *other*
chains of the batch (leave-one-out; `baseline="reward"`: their mean G_k), or, where several
chains share a prefix (`groups`), of the other chains from the same prefix. Every term is a
per-position log-quantity times a detached weight, so the loss is a weighted per-position
sum: chunked and direct computations share it (`chain_weights`, `weighted_terms`).

Shapes: N chains of γ positions; ``draft_logp, target_logp: [N, γ, V]`` (log q at the
serving temperature, unfiltered; log p filtered as the verifier does); ``tokens: [N, γ−1]``;
``mask: [N]`` bool (True = the chain counts); ``groups: [N]`` long, chains with equal ids
drawn independently from the same prefix. Imports nothing from the project but
specdistill.errors.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from specdistill.errors import UserError

ESTIMATORS = ("score", "pathwise")
BASELINES = ("coefficient", "reward")


class RowTerms(NamedTuple):
    """Per-position log-quantities, differentiable in the draft: ``log_alpha: [N, γ]``,
    ``log_r: [N, γ−1]`` (log min(1, p/q) of the sampled token) and ``log_q: [N, γ−1]``
    (log q of the sampled token)."""

    log_alpha: Tensor
    log_r: Tensor
    log_q: Tensor


class ChainWeights(NamedTuple):
    """Detached weights of the per-position terms and the chains' accepted lengths:
    ``alpha: [N, γ]`` (c_k), ``r: [N, γ−1]`` (G_k), ``q: [N, γ−1]`` (G_k − b_k; 0 for the
    pathwise estimator), ``length: [N]`` (L, 0 for masked chains)."""

    alpha: Tensor
    r: Tensor
    q: Tensor
    length: Tensor


def log_alpha_of(draft_logp: Tensor, target_logp: Tensor) -> Tensor:
    """log α = logsumexp_x min(log p, log q): [..., V] x2 -> [...]; NaN for a NaN draft
    (`losses.divergences.log_acceptance`)."""
    return torch.where(target_logp < draft_logp, target_logp, draft_logp).logsumexp(-1)


def row_terms(draft_logp: Tensor, target_logp: Tensor, tokens: Tensor) -> RowTerms:
    """The per-position terms of the chains: [N, γ, V] x2, [N, γ−1] -> `RowTerms`."""
    check_shapes(draft_logp, target_logp, tokens)
    log_alpha = log_alpha_of(draft_logp, target_logp)
    index = tokens[..., None].long()
    log_q = draft_logp[:, :-1].gather(-1, index).squeeze(-1)
    log_p = target_logp[:, :-1].gather(-1, index).squeeze(-1)
    log_r = torch.clamp_max(log_p - log_q, 0.0)
    return RowTerms(log_alpha, log_r, log_q)


def accepted_length(log_r: Tensor, log_alpha: Tensor) -> Tensor:
    """L = Σ_k exp(Σ_{j<k} log r_j + log α_k): [N, γ−1], [N, γ] -> [N], differentiable."""
    prefix = torch.cat([torch.zeros_like(log_alpha[:, :1]), log_r.cumsum(-1)], -1)
    return (prefix + log_alpha).exp().sum(-1)


def chain_weights(
    log_r: Tensor,
    log_alpha: Tensor,
    mask: Tensor | None = None,
    estimator: str = "score",
    groups: Tensor | None = None,
    baseline: str = "coefficient",
) -> ChainWeights:
    """The detached weights of the gradient estimator (module docstring) from the terms'
    values: [N, γ−1], [N, γ], [N] -> `ChainWeights`. The baseline b_k is the mean of
    G_k·1[r_k = 1] (`baseline="coefficient"`) or of G_k (`"reward"`) over the other valid
    chains of the chain's group (`groups` [N]; without it, or in a group with no other valid
    chain, of the whole batch; 0 when there is no other)."""
    if estimator not in ESTIMATORS:
        raise UserError(f"tau: estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if baseline not in BASELINES:
        raise UserError(f"tau: baseline must be one of {BASELINES}, got {baseline!r}")
    with torch.no_grad():
        log_r, log_alpha = log_r.detach(), log_alpha.detach()
        valid = torch.ones_like(log_alpha[:, 0], dtype=torch.bool) if mask is None else mask
        prefix = torch.cat([torch.zeros_like(log_alpha[:, :1]), log_r.cumsum(-1)], -1)
        c = torch.where(valid[:, None], (prefix + log_alpha).exp(), 0.0)  # [N, γ]
        to_go = c.flip(-1).cumsum(-1).flip(-1)[:, 1:]  # G_k = Σ_{m>k} c_m: [N, γ−1]
        if estimator == "pathwise":
            score = torch.zeros_like(to_go)
        else:
            # ∇log r_k = −∇log q_k(a_k) where r_k < 1, so a_k's score has the coefficient
            # G_k·1[r_k = 1] − b_k in all: the baseline estimates that (docs/theory.md)
            kept = to_go * (log_r == 0) if baseline == "coefficient" else to_go
            b = leave_one_out(kept, valid)
            if groups is not None:
                in_group = leave_one_out(kept, valid, groups)
                b = torch.where(torch.isnan(in_group), b, in_group)
            score = torch.where(valid[:, None], to_go - b, 0.0)
        return ChainWeights(c, to_go, score, c.sum(-1))


def leave_one_out(values: Tensor, valid: Tensor, groups: Tensor | None = None) -> Tensor:
    """Each row's mean of the *other* valid rows' `values` [N, K]: of the whole batch (0
    where there is no other), or of its group (`groups` [N]; NaN where there is no other).
    `values` is 0 on invalid rows."""
    if groups is None:
        n = valid.sum()
        return torch.where(
            n > 1, (values.sum(0, keepdim=True) - values) / (n - 1).clamp_min(1), 0.0
        )
    ids = torch.unique(groups, return_inverse=True)[1]
    sums = values.new_zeros(int(ids.max()) + 1, values.shape[1]).index_add_(0, ids, values)
    counts = values.new_zeros(int(ids.max()) + 1).index_add_(0, ids, valid.to(values.dtype))
    others = (counts[ids] - valid.to(values.dtype))[:, None]
    return torch.where(others > 0, (sums[ids] - values) / others.clamp_min(1), float("nan"))


def weighted_terms(terms: RowTerms, weights: ChainWeights) -> Tensor:
    """Σ_k (weight · log-term) per chain: [N]. Its gradient is the estimator's ∇J (module
    docstring); its value is not J. Terms whose weight is 0 add exactly 0 (also where a
    log-term is −inf: a sampled token the target filtered out)."""

    def dot(weight: Tensor, log_term: Tensor) -> Tensor:
        return torch.where(weight != 0, weight * log_term, 0.0).sum(-1)

    return (
        dot(weights.alpha, terms.log_alpha)
        + dot(weights.r, terms.log_r)
        + dot(weights.q, terms.log_q)
    )


def with_surrogate_grad(value: Tensor, surrogate: Tensor) -> Tensor:
    """`value` as the forward value, `surrogate`'s gradient: value + (s − sg(s))."""
    return value.detach() + (surrogate - surrogate.detach())


def tau_objective(
    draft_logp: Tensor,
    target_logp: Tensor,
    tokens: Tensor,
    mask: Tensor | None = None,
    *,
    estimator: str = "score",
    groups: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-chain loss 1 − L/γ with the estimator's gradient, and L (detached): [N] each.

    Masked chains give exactly 0 (loss and gradient). γ = 1 (no sampled token) is
    1 − α with α's gradient: the per-token ``tv`` loss.
    """
    gamma = draft_logp.shape[-2]
    terms = row_terms(draft_logp, target_logp, tokens)
    weights = chain_weights(terms.log_r, terms.log_alpha, mask, estimator, groups)
    surrogate = -weighted_terms(terms, weights) / gamma
    value = 1.0 - weights.length / gamma
    if mask is not None:
        value = torch.where(mask, value, 0.0)
    return with_surrogate_grad(value, surrogate), weights.length


def check_shapes(draft_logp: Tensor, target_logp: Tensor, tokens: Tensor) -> None:
    if draft_logp.dim() != 3 or draft_logp.shape != target_logp.shape:
        raise UserError(
            f"tau: draft and target log-probabilities must both be [chains, gamma, vocab], got "
            f"{list(draft_logp.shape)} and {list(target_logp.shape)}"
        )
    n, gamma = draft_logp.shape[:2]
    if tokens.shape != (n, gamma - 1):
        raise UserError(
            f"tau: tokens must be [chains, gamma - 1] = [{n}, {gamma - 1}] (the draft's sampled "
            f"tokens; the last position's is never needed), got {list(tokens.shape)}"
        )
