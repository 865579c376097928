"""Per-position divergences between the draft q and the target p (docs/theory.md §3), each
with its declaration (`losses.declaration.LossSpec`) right after it, and `DECLARED`, the one
registry of the losses by name.

Every function here is pure: ``fn(draft_logp, target_logp, **params) -> loss``, with
``draft_logp, target_logp: [..., vocab]`` log-probabilities over the *draft* vocabulary
and ``loss: [...]`` (vocab dim reduced). Masking, summing, temperature and target
processing live in :mod:`losses.api`, once for all of them.

``draft_logp`` is a normalised log-softmax of finite logits. ``target_logp`` is constant
(no grad; the API detaches the target) and may hold
``-inf`` (p = 0: filtered or absent tokens) and may sum to less than one when the draft
vocabulary is a subset of the target's (mass outside V_d). Acceptance-style losses
(``tv``, ``lk_alpha``, the TV part of ``lk_lambda``) use that raw p, which is the true
acceptance; KL-style losses renormalise p over the draft vocabulary first.
"""

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from specdistill.losses.chain import ESTIMATORS
from specdistill.losses.declaration import REQUIRED, SETTINGS, LossSpec, Param

# log of the smallest normal fp32 (≈ −87.3): floor for log p in reverse KL, so KL(q||p)
# stays finite where p = 0; a target whose largest p on the draft vocabulary is below it
# counts as having no mass there.
LOG_P_FLOOR = math.log(torch.finfo(torch.float32).tiny)


def log_acceptance(draft_logp: Tensor, target_logp: Tensor) -> Tensor:
    """log α = logsumexp_x min(log p(x), log q(x)): [..., vocab] x2 -> [...].

    Stable as α -> 0. The gradient goes to the draft where q <= p (ties included),
    which gives the closed-form TV gradient of docs/theory.md §3. A NaN in the draft is
    kept (the comparison is false for NaN, so the draft's entry is taken): a diverged draft
    gives log α = NaN, never the target's own mass (α = 1).
    """
    return torch.where(target_logp < draft_logp, target_logp, draft_logp).logsumexp(-1)


def renormalised(target_logp: Tensor) -> Tensor:
    """log p renormalised over the vocabulary it is given on: [..., vocab] -> same.

    log p <= 0, so Σ exp(log p) cannot overflow; the API rejects targets whose mass on the
    draft vocabulary underflows (max p < fp32 tiny), so it cannot underflow either.
    """
    return target_logp - target_logp.exp().sum(-1, keepdim=True).log()


def fkl(draft_logp: Tensor, target_logp: Tensor) -> Tensor:
    """Forward KL(p||q) = Σ p (log p − log q): [..., vocab] x2 -> [...]."""
    p = target_logp.exp()
    mass = p.sum(-1, keepdim=True)
    p /= mass  # renormalised over the draft vocabulary
    # Σ p log p, with log p = log p_raw − log mass and log p_raw clamped so that p = 0 adds
    # 0 · floor = 0: what torch.special.entr does, without its slower kernel on CPU.
    floor = math.log(torch.finfo(p.dtype).tiny)
    neg_entropy = (p * target_logp.clamp_min(floor)).sum(-1) - mass.squeeze(-1).log()
    return neg_entropy - (p * draft_logp).sum(-1)


FKL = LossSpec(fkl, "forward KL(p||q): the usual distillation loss")


def rkl(draft_logp: Tensor, target_logp: Tensor) -> Tensor:
    """Reverse KL(q||p) = Σ q (log q − log p): [..., vocab] x2 -> [...].

    log p is floored at log(fp32 tiny) ≈ −87.3, so tokens with p = 0 (filtered, sparse or
    truncated targets) cost ≈ 87·q(x) instead of +inf.
    """
    target_logp = renormalised(target_logp).clamp_min(LOG_P_FLOOR)
    return (draft_logp.exp() * (draft_logp - target_logp)).sum(-1)


RKL = LossSpec(rkl, "reverse KL(q||p), log p floored where p = 0")


def jsd(draft_logp: Tensor, target_logp: Tensor, *, beta: float = 0.5) -> Tensor:
    """Generalised JSD, scaled so both end points are the KLs: [..., vocab] x2 -> [...].

    Convention: with m = β p + (1 − β) q,
        jsd_β(p, q) = [β KL(p||m) + (1 − β) KL(q||m)] / (β (1 − β)),
    continuous on β ∈ [0, 1] with jsd_0 = KL(p||q) (``fkl``) and jsd_1 = KL(q||p) (``rkl``);
    β = 0.5 gives 4·JS(p, q). Without the 1/(β(1−β)) factor the value would vanish at both
    ends (m equals p or q there).
    """
    JSD.check(beta=beta)
    if beta == 0.0:
        return fkl(draft_logp, target_logp)
    if beta == 1.0:
        return rkl(draft_logp, target_logp)
    target_logp = renormalised(target_logp)
    log_m = torch.logaddexp(target_logp + math.log(beta), draft_logp + math.log1p(-beta))
    p = target_logp.exp()
    kl_pm = torch.where(p > 0, p * (target_logp - log_m), 0.0).sum(-1)
    kl_qm = (draft_logp.exp() * (draft_logp - log_m)).sum(-1)
    return kl_pm / (1.0 - beta) + kl_qm / beta


JSD = LossSpec(
    jsd,
    "generalised Jensen-Shannon divergence, from fkl (beta 0) to rkl (beta 1)",
    (Param("beta", float, 0.5, "p's weight in the mixture m = βp + (1 − β)q", ge=0, le=1),),
)


def tv(draft_logp: Tensor, target_logp: Tensor) -> Tensor:
    """Total variation 1 − α: [..., vocab] x2 -> [...]."""
    return -torch.expm1(log_acceptance(draft_logp, target_logp))


TV = LossSpec(tv, "total variation 1 − α: the rejection rate", end_to_end=True)


def lk_alpha(draft_logp: Tensor, target_logp: Tensor) -> Tensor:
    """LK^α = −log α: [..., vocab] x2 -> [...]. Equals CE when p is one-hot."""
    return -log_acceptance(draft_logp, target_logp)


LK_ALPHA = LossSpec(lk_alpha, "LK^α = −log α")


def lk_lambda(
    draft_logp: Tensor,
    target_logp: Tensor,
    *,
    eta: float = 3.0,
    lambda_mode: str = "batch",
    alpha_bar: Tensor | float | None = None,
) -> Tensor:
    """LK^λ = λ·KL(p||q) + (1 − λ)·TV: [..., vocab] x2 -> [...].

    λ = exp(−η·sg(ᾱ)). ``lambda_mode="batch"``: ᾱ is the mean α of the batch, given as
    ``alpha_bar`` (the API passes the masked mean over valid positions; None means the mean
    over every position given here). ``lambda_mode="token"``: ᾱ is each position's own α.
    """
    LK_LAMBDA.check(eta=eta, lambda_mode=lambda_mode, alpha_bar=alpha_bar)
    log_alpha = log_acceptance(draft_logp, target_logp)
    if lambda_mode == "token":
        if alpha_bar is not None:
            raise ValueError("lk_lambda: alpha_bar is only used with lambda_mode='batch'")
        ref = log_alpha.detach().exp()
    else:
        ref = log_alpha.detach().exp().mean() if alpha_bar is None else alpha_bar
    ref = torch.as_tensor(ref, dtype=log_alpha.dtype, device=log_alpha.device).detach()
    lam = torch.exp(-eta * ref)
    return lam * fkl(draft_logp, target_logp) - (1.0 - lam) * torch.expm1(log_alpha)


LK_LAMBDA = LossSpec(
    lk_lambda,
    "LK^λ = λ·KL(p||q) + (1 − λ)·TV, λ = exp(−η·ᾱ)",
    (
        Param("eta", float, 3.0, "η: how fast the KL part fades as α grows", ge=0),
        Param(
            "lambda_mode",
            str,
            "batch",
            "batch: ᾱ is the batch's mean α; token: each position's own α",
            choices=("batch", "token"),
        ),
        Param(
            "alpha_bar",
            float | None,
            None,
            "a fixed ᾱ (lambda_mode batch only); null: the batch's mean α",
            ge=0,
            le=1,
        ),
    ),
    batch_alpha=lambda params: params["lambda_mode"] == "batch" and params["alpha_bar"] is None,
)


def ce(draft_logp: Tensor, target_logp: Tensor) -> Tensor:
    """Cross-entropy on the target argmax, −log q(argmax p): [..., vocab] x2 -> [...]."""
    return -draft_logp.gather(-1, target_logp.argmax(-1, keepdim=True)).squeeze(-1)


CE = LossSpec(ce, "cross-entropy on the target's argmax", ranking=True)


def topk_ce(draft_logp: Tensor, target_logp: Tensor, *, k: int = 10) -> Tensor:
    """HASS-style top-k soft CE: −Σ_{x in top-k(p)} p̃(x) log q(x), p̃ = p renormalised
    over its top k: [..., vocab] x2 -> [...]."""
    TOPK_CE.check(k=k)
    if k > target_logp.shape[-1]:  # the vocabulary is known here only
        raise ValueError(f"topk_ce: k must be in [1, vocab={target_logp.shape[-1]}], got {k}")
    top_logp, index = target_logp.topk(k, dim=-1)
    return -(top_logp.softmax(-1) * draft_logp.gather(-1, index)).sum(-1)


TOPK_CE = LossSpec(
    topk_ce,
    "HASS-style soft cross-entropy on the target's top k",
    (Param("k", int, 10, "the target's top tokens it is taken over (<= the vocabulary)", ge=1),),
    ranking=True,
)


def mix(draft_logp: Tensor, target_logp: Tensor, *, parts: dict[str, float], **params) -> Tensor:
    """Weighted sum Σ_name w·loss_name: [..., vocab] x2 -> [...].

    ``parts``: {loss name: weight}, e.g. {"tv": 0.9, "fkl": 0.1}. Other params go to the
    parts that take them (e.g. ``eta`` to ``lk_lambda``, ``beta`` to ``jsd``).
    """
    check_params("mix", {"parts": parts, **params})
    return sum(
        weight * DECLARED[name].fn(draft_logp, target_logp, **own)
        for name, weight, own in mix_parts(parts, params)
    )


MIX = LossSpec(
    mix,
    "a weighted sum of losses, Σ weight · loss",
    (Param("parts", dict[str, float], REQUIRED, "{loss name: weight}, e.g. {tv: 0.9, fkl: 0.1}"),),
    composite=True,
)


def tau(
    draft_logp: Tensor,
    target_logp: Tensor,
    *,
    gamma: int | None = None,
    prefixes: int = 32,
    estimator: str = "score",
) -> Tensor:
    """The accepted-length objective: not a per-position loss, but the one of the draft's
    own γ-token chains (losses/chain.py, losses/tau.py; the training step samples the chains).
    Here for its declaration (`TAU`: its parameters ``gamma``, ``prefixes``, ``estimator``);
    the score estimator is pathwise plus score function with a leave-one-out baseline,
    pathwise the pathwise terms alone."""
    raise ValueError(
        "tau scores the draft's own chains, not teacher-forced positions: use losses.tau "
        "(tau_loss / chunked_tau_loss) on sampled chains"
    )


TAU = LossSpec(
    tau,
    "the accepted length of the draft's own chains (docs/theory.md, the accepted-length objective)",
    (
        Param(
            "gamma",
            int | None,
            None,
            "draft length γ of each chain; null: the largest eval.speculative.gammas",
            ge=1,
        ),
        Param("prefixes", int, 32, "chain starts per micro-batch row", ge=1),
        Param(
            "estimator",
            str,
            "score",
            "score: unbiased, with a leave-one-out baseline; pathwise: biased, lower variance",
            choices=ESTIMATORS,
        ),
    ),
    chain=True,
)


# Every loss by name: the one registry the recipe, its reference and the loss library read.
DECLARED: dict[str, LossSpec] = {
    spec.name: spec for spec in (FKL, RKL, JSD, TV, LK_ALPHA, LK_LAMBDA, CE, TOPK_CE, MIX, TAU)
}
# The per-position losses' functions (what `losses.api.compute_loss` computes), by name.
LOSSES: dict[str, Callable[..., Tensor]] = {
    name: spec.fn for name, spec in DECLARED.items() if not spec.chain
}


def spec_of(name: str) -> LossSpec:
    """Loss `name`'s declaration; ValueError for an unknown name."""
    if name not in DECLARED:
        raise ValueError(f"unknown loss {name!r}; valid names: {sorted(DECLARED)}")
    return DECLARED[name]


def part_names() -> list[str]:
    """The losses a composite loss may have as parts: every one that is not a composite."""
    return sorted(name for name, spec in DECLARED.items() if not spec.composite)


def declared_params(name: str, parts: Iterable[str] = ()) -> dict[str, Param]:
    """The parameters a caller may give loss `name`, each as first declared: compute_loss's
    `SETTINGS`, then the loss's own, then for a composite those of each of `parts`."""
    params: dict[str, Param] = {}
    for param in (*SETTINGS, *(p for n in (name, *parts) for p in DECLARED[n].params)):
        params.setdefault(param.name, param)
    return params


def param_names(name: str) -> set[str]:
    """The parameters loss `name`'s own function takes (for a composite: `parts`)."""
    return {param.name for param in spec_of(name).params}


def params_of(name: str, params: Mapping[str, Any]) -> dict:
    """The parameters among `params` that loss ``name``'s own function takes."""
    names = param_names(name)
    return {key: value for key, value in params.items() if key in names}


def mix_parts(parts: dict[str, float], params: Mapping[str, Any]) -> list[tuple[str, float, dict]]:
    """A composite's parts in order: (loss name, weight, the parameters of `params` it takes)."""
    return [(name, weight, params_of(name, params)) for name, weight in parts.items()]


def check_params(name: str, params: Mapping[str, Any]) -> None:
    """Raise ValueError for an unknown loss name, a bad mixture or a param nobody takes."""
    valid = param_names(name)
    if spec_of(name).composite:
        parts = params.get("parts")
        if not isinstance(parts, dict) or not parts:
            raise ValueError(
                f"{name} needs parts={{loss name: weight, ...}}, e.g. {{'tv': 0.9, 'fkl': 0.1}}"
            )
        names = part_names()
        bad = [part for part in parts if part not in names]
        if bad:
            raise ValueError(f"{name}: unknown parts {bad}; valid parts: {names}")
        valid = valid.union(*(param_names(part) for part in parts))
    unknown = sorted(set(params) - valid)
    if unknown:
        raise ValueError(f"loss {name!r}: unknown params {unknown}; valid params: {sorted(valid)}")
