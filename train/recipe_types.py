"""The building blocks of the recipe schema (train/recipe.py): the base of a section, the
field helper that carries a key's description and marks, and the value types that read YAML
as the recipe means it."""

import math
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from specdistill.train.recipe_errors import NotOneOf, RecipeError

# Field metadata (json_schema_extra): RESUME says what a resumed run may do with the key:
# "harmless" (change it freely: it does not change the trained draft) or "grow" (raise it).
# (The keys of one draft type are its own section's: train/recipe_draft.py.)
RESUME = "resume"


def recipe_key(
    default: Any = None,
    description: str = "",
    *,
    factory=None,
    resume: str | None = None,
    **constraints,
) -> Any:
    """A recipe key's pydantic Field: its default (or `factory` for a list or a section), its
    description, its range (`ge=`, `gt=`, `le=`, `lt=`, `min_length=`) and its marks."""
    extra = {RESUME: resume} if resume else None
    kwargs = {"default_factory": factory} if factory else {"default": default}
    return Field(**kwargs, description=description, json_schema_extra=extra, **constraints)


def _number(value: Any) -> Any:
    """YAML 1.1 reads `1e-3` (no dot) as a string: a number key still takes it."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _finite(value: float) -> float:
    """A number key holds a finite number: an infinity or a NaN would reach the arithmetic it
    feeds (a learning rate, a ratio, a temperature) and poison the run without an error."""
    if not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {value}")
    return value


def _one_or_more(value: Any) -> Any:
    """A single path (or number) where a list is expected is a one-element list."""
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        return [value]
    return value


CLIENT_ID = r"key-[0-9a-f]{12}"


def _client_id(value: str) -> str:
    if re.fullmatch(CLIENT_ID, value) is None:
        raise RecipeError(
            f'online.clients: {value!r} is not a client id like key-0123456789ab ("key-" + '
            "the first 12 hex digits of the sha256 of the client's API key, as the server's "
            "traffic records write it)",
            key="online.clients",
        )
    return value


RESUME_VALUES = "no (or false), auto, or the path of a checkpoint directory"


def _resume_value(value: Any) -> Any:
    """train.resume as written: YAML 1.1 reads `no` / `off` / `false` as the boolean false,
    which means `no`. True (`yes`, `on`, `true`) is refused: it does not say whether to
    continue the newest checkpoint (`auto`) or a given one."""
    if value is False:
        return "no"
    if value is True:
        raise RecipeError(
            f"train.resume must be {RESUME_VALUES}; got true (YAML reads yes / on / true as "
            "a boolean): write auto to continue from the newest checkpoint in train.output_dir",
            key="train.resume",
        )
    if isinstance(value, str) and not value.strip():
        raise RecipeError(
            f"train.resume must be {RESUME_VALUES}; got an empty string", key="train.resume"
        )
    if not isinstance(value, str):
        raise RecipeError(
            f"train.resume must be {RESUME_VALUES}; got {value!r}", key="train.resume"
        )
    return value


TEMPERATURE_VALUES = (
    "a finite temperature > 0, a distribution of served temperatures {finite temperature >= 0: "
    "weight > 0, ...} whose weights sum to 1 (e.g. {0: 0.3, 0.7: 0.5, 1.0: 0.2}), or traffic"
)


def _loss_temperature(value: Any) -> Any:
    """loss.temperature as written: a number (> 0), a {temperature: weight} distribution of
    served temperatures (0: greedy), or `traffic` (each traffic record's own sampling)."""
    value = _number(value)
    if value == "traffic":
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        if not (value > 0 and math.isfinite(value)):
            raise RecipeError(
                f"loss.temperature must be {TEMPERATURE_VALUES}; got {value}",
                key="loss.temperature",
            )
        return float(value)
    if isinstance(value, dict) and value:
        try:
            mix = {float(_number(t)): float(_number(w)) for t, w in value.items()}
        except (TypeError, ValueError):
            mix = None
        if (
            mix is not None
            and all(t >= 0 and w > 0 and math.isfinite(t) for t, w in mix.items())
            and abs(sum(mix.values()) - 1.0) <= 1e-6
        ):
            return mix
    raise RecipeError(
        f"loss.temperature must be {TEMPERATURE_VALUES}; got {value!r}", key="loss.temperature"
    )


@dataclass(frozen=True)
class OneOf:
    """A recipe value that must be one of the names `names()` gives when the recipe is
    checked: the keys of a registry in a layer this schema does not import (the drafts
    layer's types, the loss library's losses and depth weightings), so that the schema loads
    no model library and a type registered later is a valid value. The reference of the keys
    (train/recipe_docs.py) lists the names as a Literal's."""

    names: Callable[[], tuple[str, ...]]

    def __call__(self, value: Any) -> Any:
        allowed = self.names()
        if value not in allowed:
            raise NotOneOf(allowed)
        return value


def draft_types() -> tuple[str, ...]:
    """The names `draft.type` takes: the keys of the drafts layer's registry (`drafts.TYPES`)."""
    # lazy: distill's parser imports this module; --help loads no torch
    from specdistill.drafts import TYPES

    return tuple(TYPES)


def _loss_names() -> tuple[str, ...]:
    # lazy: distill's parser imports this module; --help loads no torch
    from specdistill.losses.divergences import DECLARED

    return tuple(DECLARED)


def _depth_weightings() -> tuple[str, ...]:
    # lazy: distill's parser imports this module; --help loads no torch
    from specdistill.losses.resolved import WEIGHTINGS

    return WEIGHTINGS


Float = Annotated[float, BeforeValidator(_number), AfterValidator(_finite)]
LossTemperature = Annotated[
    float | dict[float, float] | Literal["traffic"], BeforeValidator(_loss_temperature)
]
Strings = Annotated[list[str], BeforeValidator(_one_or_more)]
Ints = Annotated[list[int], BeforeValidator(_one_or_more)]
PositiveInts = Annotated[list[Annotated[int, Field(ge=1)]], BeforeValidator(_one_or_more)]
ClientIds = Annotated[
    list[Annotated[str, AfterValidator(_client_id)]], BeforeValidator(_one_or_more)
]
Resume = Annotated[str, BeforeValidator(_resume_value)]

Dtype = Literal["float32", "bfloat16", "float16"]
AnswerEngineName = Literal["specdistill", "vllm", "auto"]  # prepare.engine
DraftType = Annotated[str, BeforeValidator(OneOf(draft_types))]  # a key of drafts.TYPES
LossName = Annotated[str, BeforeValidator(OneOf(_loss_names))]  # a loss the library declares
# losses.resolved.DepthWeighting: how a multi-depth loss weighs its depths
DepthWeighting = Annotated[str, BeforeValidator(OneOf(_depth_weightings))]
MixedPrecision = Literal["no", "bf16", "fp16"]
WandbMode = Literal["offline", "online", "disabled"]
OnPolicySource = Literal["draft", "target"]
OnlinePolicy = Literal["specdistill", "osd"]
TrainOnly = Literal["acceptance_head"]  # train.only: the parts a run may train alone


class Section(BaseModel):
    """A recipe section: unknown keys refused, values of the declared type only (strict: no
    silent conversion; a number key also takes an integer or a YAML 1.1 exponent string, and a
    list key a single value)."""

    model_config = ConfigDict(extra="forbid", strict=True)


def sections_of(annotation: Any) -> list[type[Section]]:
    """The sections a key's value may be: [the section] for a section key, every member of a
    union of sections (the draft section, one per type: train/recipe_draft.py), [] for a
    value key."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return [annotation]
    if typing.get_origin(annotation) is not typing.Union:
        return []
    members = [
        typing.get_args(a)[0] if typing.get_origin(a) is Annotated else a
        for a in typing.get_args(annotation)
    ]
    return [m for m in members if isinstance(m, type) and issubclass(m, Section)]
