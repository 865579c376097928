"""A loss resolved once: a name and its parameters, checked and turned into the functions,
weights and settings the computation calls. A training step resolves its recipe's loss
before its first micro-batch (train/recipe_loss.py) and then evaluates it without looking a
name up or checking a parameter again; the library's entry points (`compute_loss`,
`multi_depth_loss`, `chunked_loss`) resolve their arguments the same way, once per call.

What a loss is made of, read from its declaration (`losses.declaration.LossSpec`), never
from its name:

- a plain loss (fkl, tv, ...) is one part of weight 1; a composite (`mix`) is
  Σ weight · part, each part given the parameters it takes (`eta` to lk_lambda, `beta` to jsd);
- the chain objective (`tau`), alone or as a part of a composite, is the accepted length of
  the draft's own chains (`ChainLoss`), computed on sampled chains (losses/tau.py), never per
  position; the other parts are the per-token loss (`TokenLoss`);
- a part that takes the batch's mean α (lk_lambda in batch mode without an `alpha_bar`)
  gets it from the caller, over the positions its loss sums (`TokenLoss.batch_alpha`);
- on a rest bin (a SparseTarget with `rest`) the ranking losses (ce, topk_ce) see the rest
  bin's target as −inf, so that it never ranks;
- a multi-depth loss weighs its depths by one of `DepthWeighting` (`DepthWeights`); the
  end_to_end weighting is the product form of the losses declared `end_to_end` (tv).
"""

import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from torch import Tensor

from specdistill.losses.declaration import SETTING_NAMES
from specdistill.losses.divergences import (
    DECLARED,
    check_params,
    mix_parts,
    params_of,
    spec_of,
)
from specdistill.losses.sampling import check_filters

# How a multi-depth loss weighs its K depths (losses/multi_depth.py; the recipe's
# loss.depth_weighting takes these names).
DepthWeighting = Literal["geometric", "expected_length", "end_to_end"]
WEIGHTINGS: tuple[str, ...] = typing.get_args(DepthWeighting)
GEOMETRIC_DECAY = 0.8  # EAGLE-3's ratio: depth_weighting=geometric without a decay


@dataclass(frozen=True)
class Sampling:
    """The target's sampling filter the loss compares at, as the verifier samples
    (`losses.sampling.filter_logits`; None: off). Checked when made."""

    top_p: float | None = None
    top_k: int | None = None

    def __post_init__(self):
        check_filters(self.top_p, self.top_k)


@dataclass(frozen=True)
class Part:
    """One weighted per-position loss of a `TokenLoss`: ``fn(draft_logp, target_logp,
    **params)``; `ranking`: it reads the target through its ranking only; `batch_alpha`: it
    takes the batch's mean α (its declaration's `batch_alpha` of its parameters)."""

    name: str
    fn: Callable[..., Tensor]
    weight: float
    params: Mapping[str, Any]
    ranking: bool
    batch_alpha: bool

    def value(self, draft_logp: Tensor, target_logp: Tensor, rest_bin: bool, alpha_bar) -> Tensor:
        """The part's unweighted loss per position: [..., V] x2 -> [...]."""
        if rest_bin and self.ranking:
            target_logp = target_logp.clone()
            target_logp[..., -1] = float("-inf")
        params = {**self.params, "alpha_bar": alpha_bar} if self.batch_alpha else self.params
        return self.fn(draft_logp, target_logp, **params)


@dataclass(frozen=True)
class TokenLoss:
    """A per-position loss: Σ weight · part over its parts (a plain loss: one part of weight
    1); `mask_out_of_vocab`: with d2t, positions whose target argmax is outside the draft's
    vocabulary are masked too."""

    name: str
    parts: tuple[Part, ...]
    mask_out_of_vocab: bool = False

    @property
    def batch_alpha(self) -> bool:
        """Whether a part takes the batch's mean α (`alpha_bar` of `per_position`)."""
        return any(part.batch_alpha for part in self.parts)

    def per_position(
        self, draft_logp: Tensor, target_logp: Tensor, rest_bin: bool = False, alpha_bar=None
    ) -> Tensor:
        """The loss at every position, [..., V] x2 -> [...]; masking is the caller's.
        `rest_bin`: the last column is a SparseTarget's rest bin; `alpha_bar`: the batch's
        mean α, for the parts that take it."""
        return sum(
            part.weight * part.value(draft_logp, target_logp, rest_bin, alpha_bar)
            for part in self.parts
        )


@dataclass(frozen=True)
class ChainLoss:
    """The accepted-length part (the loss declared `chain`): its weight in the loss and its
    parameters (`losses.divergences.tau`: the draft length γ, chain starts per micro-batch
    row, the gradient estimator)."""

    weight: float
    gamma: int
    prefixes: int
    estimator: str


@dataclass(frozen=True)
class DepthWeights:
    """How a multi-depth loss weighs its K depths (`multi_depth_loss`'s docstring)."""

    weighting: DepthWeighting
    decay: float  # the geometric ratio (weighting geometric only)


@dataclass(frozen=True)
class ResolvedLoss:
    """A recipe's loss, resolved: the per-token part (None: the chain part alone), the
    chain part (None: no accepted-length part), the target's sampling filter both compare
    at, and the depth weighting of the per-token part."""

    token: TokenLoss | None
    chain: ChainLoss | None
    sampling: Sampling
    depths: DepthWeights


def token_loss(name: str, params: Mapping[str, Any], mask_out_of_vocab: bool) -> TokenLoss:
    """Loss `name` with its own parameters (a composite: `parts` and its parts'), checked: a
    ValueError for an unknown name, a bad mixture or a parameter no part takes."""
    check_params(name, dict(params))
    if not spec_of(name).composite:
        return TokenLoss(name, (_part(name, 1.0, params),), mask_out_of_vocab)
    parts = mix_parts(params["parts"], params)
    return TokenLoss(name, tuple(_part(*part) for part in parts), mask_out_of_vocab)


def _part(name: str, weight: float, params: Mapping[str, Any]) -> Part:
    spec = DECLARED[name]
    batch_alpha = spec.batch_alpha(spec.with_defaults(params))
    own = MappingProxyType(dict(params))
    return Part(name, spec.fn, weight, own, spec.ranking, batch_alpha)


def depth_weights(name: str, weighting: str, decay: float | None) -> DepthWeights:
    """The depth weighting of loss `name`, checked: a ValueError for an unknown weighting,
    end_to_end with a loss not declared `end_to_end` (tv), or a decay with another weighting
    than geometric."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if weighting == "end_to_end" and not spec_of(name).end_to_end:
        names = " or ".join(repr(n) for n in end_to_end_losses())
        raise ValueError(
            f"weighting='end_to_end' is the multi-depth TV loss; use name={names}, got {name!r}"
        )
    if decay is not None and weighting != "geometric":
        raise ValueError(f"decay is only used with weighting='geometric', got {weighting!r}")
    return DepthWeights(weighting, GEOMETRIC_DECAY if decay is None else decay)


def end_to_end_losses() -> list[str]:
    """The losses whose multi-depth form is the product of acceptances (depth_weighting
    end_to_end)."""
    return [name for name, spec in DECLARED.items() if spec.end_to_end]


def resolve_loss(
    name: str,
    params: Mapping[str, Any],
    *,
    weighting: str,
    decay: float | None,
    default_gamma: int,
) -> ResolvedLoss:
    """A loss section resolved: `name`, `params` (the loss's own and compute_loss's
    `SETTINGS`), the depth weighting; `default_gamma` is tau's γ where its `gamma` is None.
    ValueError as `token_loss` and `depth_weights`."""
    own = {key: value for key, value in params.items() if key not in SETTING_NAMES}
    check_params(name, own)
    chain, token_name, token_params = _split_chain(name, own, default_gamma)
    mask_out_of_vocab = params.get("mask_out_of_vocab", False)
    return ResolvedLoss(
        token=None
        if token_name is None
        else token_loss(token_name, token_params, mask_out_of_vocab),
        chain=chain,
        sampling=Sampling(params.get("top_p"), params.get("top_k")),
        depths=depth_weights(name, weighting, decay),
    )


def _split_chain(
    name: str, own: dict, default_gamma: int
) -> tuple[ChainLoss | None, str | None, dict]:
    """(the chain part or None, the per-token loss's name or None, its parameters): a loss
    declared `chain` alone is the chain part of weight 1; a chain part of a composite is the
    chain part of its weight, the other parts (if any) the per-token composite."""
    spec = DECLARED[name]
    parts = dict(own["parts"]) if spec.composite else {}
    chains = [part for part in parts if DECLARED[part].chain]
    if len(chains) > 1:
        raise ValueError(f"{name}: at most one part over the draft's chains, got {chains}")
    chain_name = name if spec.chain else next(iter(chains), None)
    if chain_name is None:
        return None, name, own
    given = params_of(chain_name, own)
    rest = {key: value for key, value in own.items() if key not in given}
    token_name = None
    if spec.chain:
        weight = 1.0
    else:
        weight = parts.pop(chain_name)
        rest.pop("parts")
        token_name, rest = (name, {**rest, "parts": parts}) if parts else (None, {})
    chain_params = DECLARED[chain_name].with_defaults(given)
    chain = ChainLoss(
        weight,
        chain_params["gamma"] or default_gamma,
        chain_params["prefixes"],
        chain_params["estimator"],
    )
    return chain, token_name, rest
