"""The recipe's loss: the parameters, whose names and types depend on `loss.name` (read
from the loss library, `losses.api.loss_params`), checked and coerced (`validate_loss`), and
the loss resolved once (`resolved_loss`): the loss library's `ResolvedLoss`, whose parts,
weights and sampling settings the training step evaluates on every micro-batch without
checking them again (train/objective.py).
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
    from specdistill.losses.resolved import ResolvedLoss


def resolved_loss(recipe: Recipe) -> "ResolvedLoss":
    """The recipe's loss checked (`validate_loss`) and resolved: a
    `losses.resolved.ResolvedLoss` (tau's γ, where the recipe leaves it null, is the largest
    of eval.speculative.gammas)."""
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
    """Check the loss name and the type of each parameter against the loss library's
    declaration (coercing e.g. `eta: 3` to 3.0), then ask the library for the value checks:
    it knows each loss's ranges."""
    from specdistill.losses.api import loss_params
    from specdistill.losses.divergences import NAMES, check_param_values, param_names

    if lo.name not in NAMES:
        hint = _hint(lo.name, list(NAMES))
        raise RecipeError(f"loss: unknown loss {lo.name!r}; {hint}", key="loss.name")
    params = dict(lo.params)
    parts: dict = {}
    own = loss_params(lo.name)
    if "parts" in own and "parts" in params:  # a mixture: its parts decide which exist
        params["parts"] = parts = _coerce(params["parts"], own["parts"].type, "loss.parts")
        names = sorted(name for name in NAMES if "parts" not in param_names(name))
        for part in parts:
            if part not in names:
                raise RecipeError(
                    f"loss: {lo.name}: unknown part {part!r}; {_hint(part, names)}",
                    key="loss.parts",
                )
    declared = loss_params(lo.name, parts)
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
    lo.params = params
    try:  # the values each parameter may take, as the loss library declares them
        check_param_values(lo.name, lo.params)
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
    """The annotation of a loss parameter as a recipe reads it: the parts a recipe cannot
    write (tensors) dropped, float as the recipe's number (Any if nothing is left)."""
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
