"""Per-position divergences between the draft q and the target p (docs/theory.md §3).

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

import functools
import inspect
import math
import typing
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

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


def rkl(draft_logp: Tensor, target_logp: Tensor) -> Tensor:
    """Reverse KL(q||p) = Σ q (log q − log p): [..., vocab] x2 -> [...].

    log p is floored at log(fp32 tiny) ≈ −87.3, so tokens with p = 0 (filtered, sparse or
    truncated targets) cost ≈ 87·q(x) instead of +inf.
    """
    target_logp = renormalised(target_logp).clamp_min(LOG_P_FLOOR)
    return (draft_logp.exp() * (draft_logp - target_logp)).sum(-1)


def jsd(draft_logp: Tensor, target_logp: Tensor, *, beta: float = 0.5) -> Tensor:
    """Generalised JSD, scaled so both end points are the KLs: [..., vocab] x2 -> [...].

    Convention: with m = β p + (1 − β) q,
        jsd_β(p, q) = [β KL(p||m) + (1 − β) KL(q||m)] / (β (1 − β)),
    continuous on β ∈ [0, 1] with jsd_0 = KL(p||q) (``fkl``) and jsd_1 = KL(q||p) (``rkl``);
    β = 0.5 gives 4·JS(p, q). Without the 1/(β(1−β)) factor the value would vanish at both
    ends (m equals p or q there).
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd: beta must be in [0, 1], got {beta}")
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


def tv(draft_logp: Tensor, target_logp: Tensor) -> Tensor:
    """Total variation 1 − α: [..., vocab] x2 -> [...]."""
    return -torch.expm1(log_acceptance(draft_logp, target_logp))


def lk_alpha(draft_logp: Tensor, target_logp: Tensor) -> Tensor:
    """LK^α = −log α: [..., vocab] x2 -> [...]. Equals CE when p is one-hot."""
    return -log_acceptance(draft_logp, target_logp)


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
    if eta < 0:
        raise ValueError(f"lk_lambda: eta must be >= 0, got {eta}")
    log_alpha = log_acceptance(draft_logp, target_logp)
    if lambda_mode == "token":
        if alpha_bar is not None:
            raise ValueError("lk_lambda: alpha_bar is only used with lambda_mode='batch'")
        ref = log_alpha.detach().exp()
    elif lambda_mode == "batch":
        ref = log_alpha.detach().exp().mean() if alpha_bar is None else alpha_bar
    else:
        raise ValueError(f"lk_lambda: lambda_mode must be 'batch' or 'token', got {lambda_mode!r}")
    ref = torch.as_tensor(ref, dtype=log_alpha.dtype, device=log_alpha.device).detach()
    lam = torch.exp(-eta * ref)
    return lam * fkl(draft_logp, target_logp) - (1.0 - lam) * torch.expm1(log_alpha)


def ce(draft_logp: Tensor, target_logp: Tensor) -> Tensor:
    """Cross-entropy on the target argmax, −log q(argmax p): [..., vocab] x2 -> [...]."""
    return -draft_logp.gather(-1, target_logp.argmax(-1, keepdim=True)).squeeze(-1)


def topk_ce(draft_logp: Tensor, target_logp: Tensor, *, k: int = 10) -> Tensor:
    """HASS-style top-k soft CE: −Σ_{x in top-k(p)} p̃(x) log q(x), p̃ = p renormalised
    over its top k: [..., vocab] x2 -> [...]."""
    if not 1 <= k <= target_logp.shape[-1]:
        raise ValueError(f"topk_ce: k must be in [1, vocab={target_logp.shape[-1]}], got {k}")
    top_logp, index = target_logp.topk(k, dim=-1)
    return -(top_logp.softmax(-1) * draft_logp.gather(-1, index)).sum(-1)


def mix(draft_logp: Tensor, target_logp: Tensor, *, parts: dict[str, float], **params) -> Tensor:
    """Weighted sum Σ_name w·loss_name: [..., vocab] x2 -> [...].

    ``parts``: {loss name: weight}, e.g. {"tv": 0.9, "fkl": 0.1}. Other params go to the
    parts that take them (e.g. ``eta`` to ``lk_lambda``, ``beta`` to ``jsd``).
    """
    check_params("mix", {"parts": parts, **params})
    return sum(
        weight * NAMES[name](draft_logp, target_logp, **own)
        for name, weight, own in mix_parts(parts, params)
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
    Declared here for its parameters: ``gamma`` (draft length; None: the recipe's largest
    eval.speculative.gammas), ``prefixes`` (chain starts per micro-batch row), ``estimator``
    (``score``: unbiased, pathwise plus score function with a leave-one-out baseline;
    ``pathwise``: the pathwise terms alone, biased, lower variance)."""
    raise ValueError(
        "tau scores the draft's own chains, not teacher-forced positions: use losses.tau "
        "(tau_loss / chunked_tau_loss) on sampled chains"
    )


LOSSES: dict[str, Callable[..., Tensor]] = {
    "fkl": fkl,
    "rkl": rkl,
    "jsd": jsd,
    "tv": tv,
    "lk_alpha": lk_alpha,
    "lk_lambda": lk_lambda,
    "ce": ce,
    "topk_ce": topk_ce,
    "mix": mix,
}


# Objectives over sampled chains rather than positions: a recipe's loss.name (and a part of
# mix) may name them; the training step computes them (train/chains.py), never
# `losses.api.compute_loss`.
CHAIN_LOSSES: dict[str, Callable[..., Tensor]] = {"tau": tau}
NAMES: dict[str, Callable[..., Tensor]] = {**LOSSES, **CHAIN_LOSSES}


class LossParam(NamedTuple):
    """A keyword-only parameter of a loss function: its name, annotation and default
    (``REQUIRED`` when it has none)."""

    name: str
    type: Any
    default: Any


REQUIRED = inspect.Parameter.empty


def keyword_params(function: Callable) -> dict[str, LossParam]:
    """The keyword-only parameters of ``function`` in signature order: the one reading of the
    loss functions' signatures (``losses.api.loss_params`` builds the recipe's view on it)."""
    return dict(_keyword_params(function))


@functools.cache
def _keyword_params(function: Callable) -> tuple[tuple[str, LossParam], ...]:
    hints = typing.get_type_hints(function)
    params = []
    for p in inspect.signature(function).parameters.values():
        if p.kind is p.KEYWORD_ONLY:
            default_type = Any if p.default is p.empty or p.default is None else type(p.default)
            params.append((p.name, LossParam(p.name, hints.get(p.name, default_type), p.default)))
    return tuple(params)


def param_names(name: str) -> set[str]:
    """Keyword params that loss ``name``'s own function takes (for ``mix``: ``parts``)."""
    return set(keyword_params(NAMES[name]))


def params_of(name: str, params: dict) -> dict:
    """The parameters among `params` that loss ``name``'s own function takes."""
    names = param_names(name)
    return {key: value for key, value in params.items() if key in names}


def mix_parts(parts: dict[str, float], params: dict) -> list[tuple[str, float, dict]]:
    """A mix's parts in order: (loss name, weight, the parameters of `params` it takes)."""
    return [(name, weight, params_of(name, params)) for name, weight in parts.items()]


def check_params(name: str, params: dict) -> None:
    """Raise ValueError for an unknown loss name, a bad mixture or a param nobody takes."""
    if name not in NAMES:
        raise ValueError(f"unknown loss {name!r}; valid names: {sorted(NAMES)}")
    valid = param_names(name)
    if name == "mix":
        parts = params.get("parts")
        if not isinstance(parts, dict) or not parts:
            raise ValueError(
                "mix needs parts={loss name: weight, ...}, e.g. {'tv': 0.9, 'fkl': 0.1}"
            )
        bad = [part for part in parts if part not in NAMES or part == "mix"]
        if bad:
            names = sorted(set(NAMES) - {"mix"})
            raise ValueError(f"mix: unknown parts {bad}; valid parts: {names}")
        valid = {"parts"}.union(*(param_names(part) for part in parts))
    unknown = sorted(set(params) - valid)
    if unknown:
        raise ValueError(f"loss {name!r}: unknown params {unknown}; valid params: {sorted(valid)}")


# The declared values of the loss parameters (and of compute_loss's sampling keywords),
# checked without any tensor, so that a recipe is validated before a model is loaded. The
# functions check the same bounds when they run; topk_ce's k <= vocabulary size can only be
# checked then.
PARAM_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "beta": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    "eta": (lambda v: v >= 0, ">= 0"),
    "k": (lambda v: v >= 1, ">= 1"),
    "alpha_bar": (lambda v: v is None or 0.0 <= v <= 1.0, "in [0, 1]"),
    "lambda_mode": (lambda v: v in ("batch", "token"), "'batch' or 'token'"),
    "top_p": (lambda v: v is None or 0.0 < v <= 1.0, "in (0, 1]"),
    "top_k": (lambda v: v is None or v >= 1, ">= 1"),
    "gamma": (lambda v: v is None or v >= 1, ">= 1"),
    "prefixes": (lambda v: v >= 1, ">= 1"),
    "estimator": (lambda v: v in ("score", "pathwise"), "'score' or 'pathwise'"),
}


# compute_loss's keywords that a caller gives beside a loss's own parameters (a recipe's loss
# section writes them among them): the target's sampling filter and the vocabulary mask.
SETTINGS = ("top_p", "top_k", "mask_out_of_vocab")


def check_param_values(name: str, params: dict) -> None:
    """Raise ValueError for an unknown parameter or a value outside its declared set."""
    check_params(name, {k: v for k, v in params.items() if k not in SETTINGS})
    for key, value in params.items():
        ok, allowed = PARAM_CHECKS.get(key, (lambda v: True, ""))
        if not ok(value):
            raise ValueError(f"{name}: {key} must be {allowed}, got {value!r}")
