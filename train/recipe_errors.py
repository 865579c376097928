"""`RecipeError` and the translation of pydantic's validation errors into its one-line
messages: the dotted key, the value, the allowed set or range, and a did-you-mean for an
unknown key. pydantic's own error text never reaches the user.
"""

import difflib
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Tag, ValidationError
from pydantic.fields import FieldInfo

from specdistill.errors import UserError


class RecipeError(UserError):
    """A recipe key is unknown or its value is invalid. `key`: the dotted key the message is
    about, when it is about one (used to point at the recipe file's line)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class NotOneOf(ValueError):
    """A value outside a set of names read when the recipe is checked
    (`recipe_types.OneOf`): translated as a Literal's error is, naming the key, the value
    and the names."""

    def __init__(self, allowed: tuple):
        super().__init__(f"must be one of {', '.join(map(str, allowed))}")
        self.allowed = allowed


# pydantic error types -> what the value must be
_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "dataclass_type": "a mapping",
}
_BOUNDS = ("ge", "gt", "le", "lt")
_OPERATORS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def dotted(loc: tuple, prefix: str = "") -> str:
    """('eval', 'speculative', 'gammas', 2) -> 'eval.speculative.gammas[2]'."""
    key = prefix
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]"
        else:
            key = f"{key}.{part}" if key else str(part)
    return key


def did_you_mean(name: str, valid: list[str]) -> str | None:
    close = difflib.get_close_matches(name, valid, n=1)
    return close[0] if close else None


def unknown_key(key: str, valid: list[str]) -> RecipeError:
    prefix = key.rsplit(".", 1)[0] + "." if "." in key else ""
    close = did_you_mean(key.rsplit(".", 1)[-1], valid)
    hint = f"did you mean '{prefix}{close}'?" if close else f"valid keys: {', '.join(valid)}"
    return RecipeError(f"unknown recipe key '{key}'; {hint}", key=key)


def translate(error: ValidationError, root: Any, prefix: str = "") -> RecipeError:
    """The first problem of `error` as a RecipeError (an unknown key before a bad value).

    root: the model (or type) that was validated; prefix: the dotted key it sits at."""
    errors = error.errors()
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = untagged(root, first["loc"])
    key = dotted(loc, prefix)
    parent, annotation, bounds = resolve(root, first["loc"])
    kind = first["type"]
    value = first.get("input")
    if kind == "extra_forbidden":
        valid = list(parent.model_fields) if _is_model(parent) else []
        return unknown_key(key, valid)
    if kind in ("value_error", "assertion_error"):
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, NotOneOf):
            return RecipeError(literal_message(key, value, cause.allowed), key=key)
        if isinstance(cause, RecipeError):
            return RecipeError(str(cause), key=cause.key or key)
        return RecipeError(f"{key}: {cause or first['msg']}", key=key)
    if kind == "literal_error":
        return RecipeError(literal_message(key, value, _literal_args(annotation)), key=key)
    if kind in _TYPE_WORDS:
        if not key:
            return RecipeError(f"recipe must be a mapping of sections, got {value!r}")
        words = _TYPE_WORDS[kind] + (" or null" if nullable(annotation) else "")
        return RecipeError(f"{key} must be {words}, got {value!r}", key=key)
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        bounds = bounds or {k: v for k, v in (first.get("ctx") or {}).items() if k in _BOUNDS}
        if _base(annotation) is float and isinstance(value, int):
            value = float(value)
        return RecipeError(f"{key} must be {range_text(bounds, annotation)}, got {value}", key=key)
    if kind == "too_short":
        need = (first.get("ctx") or {}).get("min_length", 1)
        size = "must not be empty" if need == 1 else f"must hold at least {need} items"
        return RecipeError(f"{key} {size}, got {value!r}", key=key)
    return RecipeError(f"{key}: {first['msg'].lower()}, got {value!r}", key=key)


def literal_message(key: str, value: Any, allowed: tuple) -> str:
    close = did_you_mean(str(value), [str(a) for a in allowed])
    hint = f"; did you mean {close!r}?" if close else ""
    return f"{key} must be one of {', '.join(map(str, allowed))}, got {value!r}{hint}"


def range_text(bounds: dict, annotation: Any = None) -> str:
    """{'gt': 0, 'lt': 1} -> 'in (0, 1)'; {'ge': 1} -> '>= 1' ('>= 1 or null' if nullable)."""
    low = next(((k, bounds[k]) for k in ("ge", "gt") if k in bounds), None)
    high = next(((k, bounds[k]) for k in ("le", "lt") if k in bounds), None)
    if low and high:
        opening, closing = "[" if low[0] == "ge" else "(", "]" if high[0] == "le" else ")"
        text = f"in {opening}{low[1]}, {high[1]}{closing}"
    else:
        kind, limit = low or high
        text = f"{_OPERATORS[kind]} {limit}"
    return f"{text} or null" if nullable(annotation) else text


def bounds_of(metadata: list) -> dict:
    """The ge / gt / le / lt constraints among a field's metadata (annotated_types objects)."""
    found = {}
    for item in metadata:
        if isinstance(item, FieldInfo):  # Annotated[int, Field(ge=1)]
            found.update(bounds_of(item.metadata))
        for name in _BOUNDS:
            if getattr(item, name, None) is not None:
                found[name] = getattr(item, name)
    return found


def resolve(root: Any, loc: tuple) -> tuple[Any, Any, dict]:
    """(the model holding the last named key of `loc`, the annotation at `loc`, its bounds)."""
    parent, annotation, bounds = root, root, {}
    for part in loc:
        inner = strip_optional(annotation)
        if (member := tagged_member(inner, part)) is not None:
            annotation = member  # a union's tag (the draft section's type): not a key
        elif isinstance(part, str) and _is_model(inner):
            info = inner.model_fields.get(part)
            if info is None:
                return inner, None, {}
            parent, annotation, bounds = inner, info.annotation, bounds_of(info.metadata)
        elif isinstance(part, int) and typing.get_origin(_base(inner)) is list:
            (annotation,) = typing.get_args(_base(inner))
            bounds = bounds_of(list(typing.get_args(annotation)[1:]))
        elif isinstance(part, str) and typing.get_origin(_base(inner)) is dict:
            annotation, bounds = typing.get_args(_base(inner))[1], {}
        else:
            return parent, None, {}
    return parent, annotation, bounds


def tagged_member(annotation: Any, part: Any) -> Any:
    """The member of a tagged union (`Annotated[X, Tag(part)]`) that `part` names; None when
    `annotation` is no such union or has no such tag."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is not typing.Union:
        return None
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is Annotated:
            member, *marks = typing.get_args(arg)
            if any(isinstance(m, Tag) and m.tag == part for m in marks):
                return member
    return None


def untagged(root: Any, loc: tuple) -> tuple:
    """`loc` without the tags of the tagged unions it passes through: the recipe's keys."""
    kept = []
    for i, part in enumerate(loc):
        _, annotation, _ = resolve(root, loc[:i])
        if tagged_member(strip_optional(annotation), part) is None:
            kept.append(part)
    return tuple(kept)


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def nullable(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (types.UnionType, typing.Union) and type(
        None
    ) in typing.get_args(annotation)


def strip_optional(annotation: Any) -> Any:
    """`X | None` -> X (other unions unchanged)."""
    if nullable(annotation):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _base(annotation: Any) -> Any:
    """Annotated[X, ...] -> X."""
    annotation = strip_optional(annotation)
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _literal_args(annotation: Any) -> tuple:
    base = _base(annotation)
    return typing.get_args(base) if typing.get_origin(base) is Literal else ()
