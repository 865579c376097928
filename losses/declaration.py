"""How a loss declares itself: its parameters (`Param`: name, type, default, bounds, a one-line
doc) and what it is (`LossSpec`: its function, a one-line doc, and the flags by which the rest
of the project treats it: a composite of parts, an objective over chains, a ranking loss, the
end-to-end multi-depth form, a taker of the batch's mean α).

Each loss's declaration sits beside its function (losses/divergences.py); the recipe's
checks, its overrides, the reference of its keys (docs/recipe-keys.md) and the function's own
argument checks all read it, and nothing else names a loss's parameters or bounds. `SETTINGS`
declares compute_loss's keywords that every loss takes (the target's sampling filter and the
vocabulary mask). Standard library only: a recipe is checked without any tensor.
"""

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

REQUIRED = inspect.Parameter.empty  # the default of a parameter that has none

_SCALARS = (bool, int, float, str)


@dataclass(frozen=True)
class Param:
    """A keyword parameter of a loss: `type` is the value a recipe writes (bool, int, float,
    str, ``X | None``, ``dict[str, float]``); `default` (`REQUIRED`: none); `doc`, one line;
    the bounds `ge`, `gt`, `le`, `lt` of a number, or the `choices` of a string. A value that
    is not a plain number or string (a tensor a caller passes) is the caller's to check."""

    name: str
    type: Any
    default: Any = REQUIRED
    doc: str = ""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] = ()

    @property
    def allowed(self) -> str:
        """The values it may take, in words: 'in [0, 1]', '>= 1', "'batch' or 'token'"; ''
        when any value of its type is."""
        if self.choices:
            return " or ".join(repr(choice) for choice in self.choices)
        low = next(((op, v) for op, v in ((">=", self.ge), (">", self.gt)) if v is not None), None)
        high = next(((op, v) for op, v in (("<=", self.le), ("<", self.lt)) if v is not None), None)
        if low and high:
            opening, closing = "[" if low[0] == ">=" else "(", "]" if high[0] == "<=" else ")"
            return f"in {opening}{low[1]}, {high[1]}{closing}"
        if low or high:
            op, limit = low or high
            return f"{op} {limit}"
        return ""

    def admits(self, value: Any) -> bool:
        """Whether `value` is within the declared bounds or choices (None always is: the
        type says whether it may be None; so is a value that is no plain number or string)."""
        if value is None or not isinstance(value, _SCALARS):
            return True
        if self.choices:
            return value in self.choices
        if isinstance(value, str):
            return True
        checks = (
            (self.ge, lambda v, b: v >= b),
            (self.gt, lambda v, b: v > b),
            (self.le, lambda v, b: v <= b),
            (self.lt, lambda v, b: v < b),
        )
        bounded = any(bound is not None for bound, _ in checks)
        if bounded and isinstance(value, float) and math.isnan(value):
            return False
        return all(bound is None or holds(value, bound) for bound, holds in checks)

    def check(self, value: Any, where: str) -> None:
        """ValueError ``{where} must be {allowed}, got {value!r}`` unless `admits(value)`."""
        if not self.admits(value):
            raise ValueError(f"{where} must be {self.allowed}, got {value!r}")


def _never(params: Mapping[str, Any]) -> bool:
    return False


@dataclass(frozen=True)
class LossSpec:
    """A loss's one declaration: its function ``fn(draft_logp, target_logp, **params)`` (its
    name is the loss's), a one-line `doc`, its `params` in the function's keyword order, and:

    - `composite`: a weighted sum of other losses (`parts`: {name: weight}); it also takes
      the parameters of its parts;
    - `chain`: an objective over the draft's own sampled chains, not per position (the
      training step computes it; the loss library's per-position entry points refuse it);
    - `ranking`: it reads the target only through its ranking of tokens (argmax, top k), so
      on a rest bin it ranks the known tokens only;
    - `end_to_end`: its multi-depth form is the product of the depths' acceptances
      (depth_weighting end_to_end);
    - `batch_alpha(params)`: whether, with `params` (its own, defaults filled in), it takes
      the batch's mean α as its ``alpha_bar``.

    The function's keyword-only parameters must be the declared ones, in order and with the
    same defaults: checked when the declaration is made."""

    fn: Callable[..., Any]
    doc: str
    params: tuple[Param, ...] = ()
    composite: bool = False
    chain: bool = False
    ranking: bool = False
    end_to_end: bool = False
    batch_alpha: Callable[[Mapping[str, Any]], bool] = field(default=_never)

    def __post_init__(self):
        signature = [
            (p.name, p.default)
            for p in inspect.signature(self.fn).parameters.values()
            if p.kind is p.KEYWORD_ONLY
        ]
        declared = [(p.name, p.default) for p in self.params]
        if signature != declared:
            raise TypeError(
                f"loss {self.name}: its function's keyword parameters {signature} are not "
                f"the declared ones {declared}"
            )

    @property
    def name(self) -> str:
        return self.fn.__name__

    def param(self, key: str) -> Param:
        return next(p for p in self.params if p.name == key)

    def with_defaults(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Its own parameters among `params`, the missing ones at their defaults."""
        return {
            p.name: params.get(p.name, p.default)
            for p in self.params
            if p.name in params or p.default is not REQUIRED
        }

    def check(self, **values: Any) -> None:
        """ValueError ``{loss}: {key} must be {allowed}, got {value!r}`` for the first value
        outside its declared bounds: the function's own check of its arguments."""
        for key, value in values.items():
            self.param(key).check(value, f"{self.name}: {key}")


SETTINGS: tuple[Param, ...] = (
    Param(
        "top_p",
        float | None,
        None,
        "the target's nucleus filter, as the verifier samples (null: off)",
        gt=0,
        le=1,
    ),
    Param("top_k", int | None, None, "the target's top-k filter (null: off)", ge=1),
    Param(
        "mask_out_of_vocab",
        bool,
        False,
        "with a reduced draft vocabulary, also mask positions whose target argmax is outside it",
    ),
)
TOP_P, TOP_K, MASK_OUT_OF_VOCAB = SETTINGS
SETTING_NAMES = frozenset(param.name for param in SETTINGS)
