"""The recipe's loss: the parameters, whose names, types and bounds are those the loss
`loss.name` declares (`losses.declaration.LossSpec`, in `losses.divergences.DECLARED`), checked
and coerced (`validate_loss`), and the loss resolved once (`resolved_loss`): the loss
library's `ResolvedLoss`, whose parts, weights and sampling settings the training step
evaluates on every micro-batch without checking them again (train/objective.py).
"""

import functools
import operator
import types
import typing
from typing import TYPE_CHECKING, Any

from pydantic import ConfigDict, TypeAdapter, ValidationError

from specdistill.train.recipe import LossConfig, Recipe
from specdistill.train.recipe_errors import RecipeError, did_you_mean, translate
from specdistill.train.recipe_types import Float

if TYPE_CHECKING:
    from specdistill.losses.resolved import ResolvedLoss  # lazy: for the type hints only


def resolved_loss(recipe: Recipe) -> "ResolvedLoss":
    """The recipe's loss checked (`validate_loss`) and resolved: a
    `losses.resolved.ResolvedLoss` (tau's γ, where the recipe leaves it null, is the largest
    of eval.speculative.gammas)."""
    # lazy: distill's parser imports this module; --help loads no torch
    from specdistill.losses.resolved import resolve_loss

    lo = recipe.loss
    validate_loss(lo)
    return resolve_loss(
        lo.name,
        lo.params,
        weighting=lo.depth_weighting,
        decay=lo.depth_decay,
        default_gamma=max(recipe.eval.speculative.gammas),
    )


def validate_loss(lo: LossConfig) -> None:
    """Check the loss's parameters against its declaration (`losses.declaration.LossSpec`,
    `losses.divergences.DECLARED`): each name, its type (coercing e.g. `eta: 3` to 3.0) and
    its bounds, every message naming the recipe key; then the library's checks of the whole
    (a composite's parts). The name itself is the schema's (`recipe_types.LossName`)."""
    # lazy: distill's parser imports this module; --help loads no torch
    from specdistill.losses.declaration import SETTING_NAMES

    # lazy: distill's parser imports this module; --help loads no torch
    from specdistill.losses.divergences import DECLARED, check_params, declared_params, part_names

    if lo.name not in DECLARED:  # the schema's check; a config assigned since is not
        hint = _hint(lo.name, list(DECLARED))
        raise RecipeError(f"loss: unknown loss {lo.name!r}; {hint}", key="loss.name")
    spec = DECLARED[lo.name]
    params = dict(lo.params)
    parts: dict = {}
    if spec.composite and "parts" in params:  # a mixture: its parts decide which exist
        parts_param = spec.param("parts")
        params["parts"] = parts = _coerce(params["parts"], parts_param.type, "loss.parts")
        names = part_names()
        for part in parts:
            if part not in names:
                raise RecipeError(
                    f"loss: {lo.name}: unknown part {part!r}; {_hint(part, names)}",
                    key="loss.parts",
                )
    declared = declared_params(lo.name, parts)
    own_keys = sorted(set(LossConfig.model_fields) - {"params"})
    for key, value in params.items():
        if key not in declared:
            valid = sorted(declared) or ["(none)"]
            close = did_you_mean(key, sorted(declared) + own_keys)
            hint = f"did you mean 'loss.{close}'? " if close else ""
            raise RecipeError(
                f"loss: {lo.name} takes no parameter 'loss.{key}'; {hint}"
                f"its parameters: {', '.join(valid)}",
                key=f"loss.{key}",
            )
        params[key] = _coerce(value, declared[key].type, f"loss.{key}")
        try:
            declared[key].check(params[key], f"loss.{key}")
        except ValueError as e:
            raise RecipeError(f"loss: {lo.name}: {e}", key=f"loss.{key}") from None
    lo.params = params
    try:  # the whole: a composite's parts
        check_params(lo.name, {k: v for k, v in params.items() if k not in SETTING_NAMES})
    except ValueError as e:
        raise RecipeError(f"loss: {e}") from None


def _hint(name: str, valid: list[str]) -> str:
    close = did_you_mean(name, valid)
    return (f"did you mean {close!r}? " if close else "") + f"valid: {', '.join(sorted(valid))}"


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """`value` validated as a recipe value of `annotation` (strict, numbers from YAML)."""
    tp = recipe_type(annotation)
    try:
        return _adapter(tp).validate_python(value)
    except ValidationError as e:
        raise translate(e, tp, key) from None


@functools.cache
def _adapter(tp: Any) -> TypeAdapter:
    return TypeAdapter(tp, config=ConfigDict(strict=True))


_RECIPE_TYPES = (bool, int, str, type(None))


def recipe_type(tp: Any) -> Any:
    """The declared type of a loss parameter (`losses.declaration.Param.type`) as a recipe
    reads it: float as the recipe's number (an integer too, finite); a type a recipe cannot
    write is Any (dropped from a union)."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        kept = [recipe_type(arg) for arg in typing.get_args(tp)]
        kept = [arg for arg in kept if arg is not Any]
        return functools.reduce(operator.or_, kept) if kept else Any
    if tp is float:
        return Float
    if origin is list:
        (item,) = typing.get_args(tp)
        return list[recipe_type(item)]
    if origin is dict:
        key, item = typing.get_args(tp)
        return dict[key, recipe_type(item)]
    return tp if tp in _RECIPE_TYPES else Any
