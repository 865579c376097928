"""The reference of every recipe key, generated from the schema (train/recipe.py) and the
losses' declarations (losses.divergences.DECLARED):

    python -m specdistill.train.recipe_docs > docs/recipe-keys.md

tests/train/test_config.py fails when the committed file differs from `render()`.
"""

import sys
import types
import typing
from typing import Annotated, Any, Literal

from specdistill.losses.declaration import REQUIRED, SETTINGS
from specdistill.losses.divergences import DECLARED
from specdistill.train.recipe import RESUME, Recipe, Section
from specdistill.train.recipe_draft import DRAFT_SECTIONS, DraftSection, own_fields
from specdistill.train.recipe_errors import bounds_of, nullable, range_text, strip_optional
from specdistill.train.recipe_loss import recipe_type
from specdistill.train.recipe_types import OneOf, sections_of

DOC = "docs/recipe-keys.md"
COMMAND = "python -m specdistill.train.recipe_docs > docs/recipe-keys.md"
RESUME_WORDS = {"harmless": "may change", "grow": "may grow"}

INTRO = f"""# Recipe keys

<!-- Generated from train/recipe.py by `{COMMAND}`; do not edit by hand. -->

A recipe is a YAML file of sections (`target`, `draft`, `data`, `loss`, `train`, `eval`,
`acceptance_head`, `wandb`, `online`); a key left out takes its default. Any key can be set
on the command line as `key.sub=value`, the value read as YAML (`train.max_steps=50`,
`data.train=[a.jsonl, b.jsonl]`, `wandb.project=null`). An unknown key or a bad value stops
the run with one line that names the key, the value and what it may be (`unknown recipe key
'train.max_step'; did you mean 'train.max_steps'?`), with the file and line when the recipe
file sets it.

One key stands outside the sections: `extends`, at the top level, names the recipe's parents
(one file or a list, relative to the recipe's own file, or a shipped recipe's name). The
parents are merged in order under the file, section by section; the file's own values win,
and the overrides apply last. `specdistill recipe show RECIPE` prints the result, each value
with the file and line, override or default that set it
([training.md](training.md#a-recipe-that-extends-another-and-specdistill-recipe-show)).

The `draft` section is one per draft type, picked by `draft.type`: the keys every type takes,
then each type's own; a key of another type is refused (`draft.ttt_steps apply to
draft.type=eagle3 only, not draft.type=standalone`).

Columns: **type** (a list key also takes a single value, read as a one-element list; a number
key takes an integer too), **allowed** (the values or the range), **resume** (what a resumed
run, `train.resume`, may do with it: *may change* does not change the trained draft; every
other key must keep the checkpoint's value).
"""


def render() -> str:
    parts = [INTRO]
    for name, field in Recipe.model_fields.items():
        if len(sections_of(field.annotation)) > 1:
            parts += _draft_sections(name, field.description, _marks(field))
        else:
            parts += _section(name, field.annotation, field.description, _marks(field))
    parts.append(_loss_params())
    return "\n".join(parts)


def _draft_sections(key: str, description: str, marks: dict) -> list[str]:
    """The draft section: the keys every type takes, then each type's own."""
    parts = _section(key, DraftSection, description, marks)
    for kind, section in DRAFT_SECTIONS.items():
        fields = own_fields(section)
        about = " ".join((section.__doc__ or "").split())
        if not fields:
            about += " No keys of its own: the keys above."
            parts += [f"## `{key}` with `type: {kind}`\n", f"{about}\n"]
            continue
        parts += _section(f"{key}", section, about, marks, fields, f" with `type: {kind}`")
    return parts


def _marks(field) -> dict:
    return dict(field.json_schema_extra or {})


def _section(
    key: str,
    model: type[Section],
    description: str,
    marks: dict,
    fields: dict | None = None,
    title: str = "",
) -> list[str]:
    """The section's table (of `fields`: default all the model's), then its subsections'."""
    rows, subsections = [], []
    for name, field in (model.model_fields if fields is None else fields).items():
        own = {**marks, **_marks(field)}
        if isinstance(field.annotation, type) and issubclass(field.annotation, Section):
            subsections += _section(f"{key}.{name}", field.annotation, field.description, own)
            continue
        rows.append(
            "| "
            + " | ".join(
                [
                    f"`{key}.{name}`",
                    type_text(field.annotation),
                    f"`{_value(field.get_default(call_default_factory=True))}`",
                    _allowed(field),
                    RESUME_WORDS.get(own.get(RESUME), ""),
                    _cell(field.description or ""),
                ]
            )
            + " |"
        )
    head = [
        f"## `{key}`{title}\n",
        f"{description}\n",
        "| key | type | default | allowed | resume | description |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    return head + subsections


def type_text(annotation: Any) -> str:
    """The recipe's name of a value type: int, number, bool, string, list of ..., mapping."""
    if nullable(annotation):
        return f"{type_text(strip_optional(annotation))} or null"
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return "string"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(type_text(arg) for arg in args))
    if origin is list:
        return f"list of {type_text(args[0])}s"
    if origin is dict:
        return "mapping" if args[1] is Any else f"mapping to {type_text(args[1])}"
    words = {int: "int", float: "number", bool: "bool", str: "string"}
    if annotation in words:
        return words[annotation]
    return "any" if annotation is Any else str(annotation)


def _allowed(field) -> str:
    for item in field.metadata:  # a value checked against a registry (`OneOf`)
        if isinstance(getattr(item, "func", None), OneOf):
            return ", ".join(f"`{v}`" for v in item.func.names())
    base = strip_optional(field.annotation)
    while typing.get_origin(base) is Annotated:
        base = typing.get_args(base)[0]
    if typing.get_origin(base) is Literal:
        return ", ".join(f"`{v}`" for v in typing.get_args(base))
    texts = []
    if bounds := bounds_of(field.metadata):
        texts.append(range_text(bounds))
    if typing.get_origin(base) is list:
        (item,) = typing.get_args(base)
        if item_bounds := bounds_of(list(typing.get_args(item)[1:])):
            texts.append(f"items {range_text(item_bounds)}")
    if any(getattr(m, "min_length", None) for m in field.metadata):
        texts.append("not empty")
    return "; ".join(texts)


def _value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _cell(text: str) -> str:
    """`text` as a table cell: its `|` escaped."""
    return text.replace("|", "\\|")


def _loss_params() -> str:
    """The losses and their parameters, as each loss declares them
    (`losses.declaration.LossSpec`): names, types, defaults, bounds and docs."""
    losses = [
        f"| `{name}` | {_cell(spec.doc)} | {', '.join(f'`loss.{p.name}`' for p in spec.params)} |"
        for name, spec in DECLARED.items()
    ]
    takers = {param.name: ["every loss"] for param in SETTINGS}
    declared = {param.name: param for param in SETTINGS}
    for name, spec in DECLARED.items():
        for param in spec.params:
            takers.setdefault(param.name, []).append(name)
            declared.setdefault(param.name, param)
    rows = []
    for key, param in declared.items():
        default = "required" if param.default is REQUIRED else f"`{_value(param.default)}`"
        rows.append(
            f"| `loss.{key}` | {', '.join(takers[key])} | {type_text(recipe_type(param.type))} "
            f"| {default} | {param.allowed} | {_cell(param.doc)} |"
        )
    return "\n".join(
        [
            "## Losses\n",
            "The values of `loss.name`, each with the parameters it takes besides those every "
            "loss takes (docs/theory.md §3). A composite (`mix`) also takes those of its "
            "`parts`.\n",
            "| loss | what it is | its parameters |",
            "|---|---|---|",
            *losses,
            "",
            "## Loss parameters\n",
            "Each loss's parameters, as the loss declares them (`losses.declaration`); written "
            "flat (`loss.eta: 3.0`) or under `loss.params`. A loss refuses a parameter it does "
            "not take.\n",
            "| key | losses | type | default | allowed | description |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )


if __name__ == "__main__":
    sys.stdout.write(render())
