"""Verification of one speculative round (docs/theory.md §2), for every row of a batch.

Sampled: d_i is accepted while u_i·q_i(d_i) < p_i(d_i) (u_i ~ U[0, 1)); at the first
rejection one token is drawn from the residual max(0, p_i − q_i)/Σ, and when all γ are
accepted a bonus token is drawn from p_{γ+1}. The output is distributed exactly as sampling
from p, for any q, as long as q is the distribution each draft was drawn from.
Greedy (temperature 0): d_i is accepted while it equals the target's argmax, and the
target's argmax is emitted.

Ragged rounds (`lengths`): row b proposes only its first lengths[b] drafts (the rest of its
row is padding); it accepts at most lengths[b], and when it accepts all of them its next
token is the bonus, drawn from the target's own p at that position.
"""

import torch


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row from probs [B, V] -> [B], by inverting the CDF.

    Same distribution as `torch.multinomial(probs, 1)`, several times faster on CPU.
    """
    cdf = probs.cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=cdf.dtype)
    token = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_max(probs.shape[-1] - 1)
    # u · total can round up to the total; never return a token without mass.
    empty = probs.gather(-1, token) == 0
    return torch.where(empty, probs.argmax(-1, keepdim=True), token).squeeze(-1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Residual distribution max(0, p − q)/Σ: p, q [B, V] -> [B, V]; p where the residual is empty.

    With q = 0 (the bonus position) this is p itself. An empty residual only arises from
    rounding, since a rejection requires p(d) < q(d).
    """
    rest = (p - q).clamp_min(0.0)
    total = rest.sum(-1, keepdim=True)
    return torch.where(total > 0, rest / total.clamp_min(1e-30), p)


def verify_sampled(
    p: torch.Tensor,
    q: torch.Tensor,
    drafts: torch.Tensor,
    generator: torch.Generator,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative-sampling verification of one round for every row.

    p: [B, γ+1, V] target probabilities; q: [B, γ, V] draft probabilities; drafts: [B, γ].
    Returns (n_accepted [B], next_token [B]): the row commits drafts[:n] then next_token,
    drawn from the residual at the first rejection or from p_{γ+1} (bonus) if all accepted.
    lengths [B]: drafts each row proposes (None: all γ); see the module docstring.
    """
    batch, gamma = drafts.shape
    p_draft = p[:, :gamma].gather(-1, drafts[..., None]).squeeze(-1)
    q_draft = q.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand(batch, gamma, generator=generator, device=p.device)
    accept = u * q_draft < p_draft  # u < p/q, i.e. accepted with probability min(1, p/q)
    if lengths is not None:
        accept &= torch.arange(gamma, device=p.device)[None, :] < lengths[:, None]
    n_accepted = accept.long().cumprod(1).sum(1)
    q_padded = torch.cat([q, q.new_zeros(batch, 1, q.shape[-1])], dim=1)
    rows = torch.arange(batch, device=p.device)
    q_next = q_padded[rows, n_accepted]
    if lengths is not None:  # past a row's last proposed draft: the bonus, from p itself
        q_next = q_next * (n_accepted < lengths)[:, None]
    next_token = draw(residual(p[rows, n_accepted], q_next), generator)
    return n_accepted, next_token


def verify_greedy(
    target_logits: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: target_logits [B, γ+1, V], drafts [B, γ] -> (n_accepted, next) [B].
    lengths [B]: drafts each row proposes (None: all γ)."""
    best = target_logits.argmax(-1)
    gamma = drafts.shape[1]
    n_accepted = (drafts == best[:, :gamma]).long().cumprod(1).sum(1)
    if lengths is not None:
        n_accepted = torch.minimum(n_accepted, lengths)
    return n_accepted, best.gather(1, n_accepted[:, None]).squeeze(1)
