"""The draft type registry: the one place that tells draft types apart.

Each type registers its class with `register(priority)` (a decorator, in the type's own
subpackage); the registry then answers, in the declared priority order (lowest first), which
type a directory holds (`detect`, each type's `detect(path)`), which type a loaded draft
module is (`type_of`, each type's `detect_loaded(model)`) and which type loads a draft by
name (`loading`, whose `load` hook the generic loader calls: drafts/loader.py). The last
registered by priority is the fallback, which must recognise any model directory (the
standalone type: any Hugging Face causal LM).

`TYPES` maps a recipe's `draft.type` to its class; a variant of a type (a reduced output
vocabulary, another directory layout of the same head: `register(..., variant=True)`) is
detected and loaded but takes no name of its own (its `name` is its base type's).

`read_config` reads a draft directory's config.json, which the types' `detect` hooks and the
export's writers read.
"""

import json
from pathlib import Path
from typing import Any

from specdistill.errors import UserError

TYPES: dict[str, Any] = {}  # the recipe's draft.type -> the type class
ORDER: list[tuple[int, Any]] = []  # (priority, type class), lowest priority first


def register(priority: int, *, variant: bool = False):
    """A class decorator: `cls` is asked at `priority` (lower first; ties in registration
    order) by `detect`, `type_of` and `loading`; unless a `variant`, `cls.name` becomes a
    recipe's `draft.type`."""

    def add(cls):
        if not variant:
            if TYPES.get(cls.name, cls) is not cls:
                raise ValueError(f"draft type {cls.name!r} is registered already")
            TYPES[cls.name] = cls
        ORDER[:] = sorted(
            [entry for entry in ORDER if entry[1] is not cls] + [(priority, cls)],
            key=lambda entry: entry[0],
        )
        return cls

    return add


def detected() -> tuple:
    """The registered type classes in the order they are asked."""
    return tuple(kind for _, kind in ORDER)


def detect(path) -> Any:
    """The type class of a draft directory: the first, in priority order, whose `detect`
    recognises it. Raises a UserError for a directory without config.json, which is no
    draft of any type."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(
            f"{path}: no config.json; a draft directory is an EAGLE-3 head (speculators or "
            "SGLang layout) or a Hugging Face causal LM directory"
        )
    return next(kind for kind in detected() if kind.detect(path))


def type_of(model) -> Any:
    """The type class of a loaded draft module: the first, in priority order, whose
    `detect_loaded` recognises it."""
    return next(kind for kind in detected() if kind.detect_loaded(model))


def loading(path: str | None) -> Any:
    """The type class whose `load` loads a draft: the detected type of its local model
    directory `path`, else (None: a hub name) the fallback, the last in priority order."""
    return detect(path) if path is not None else detected()[-1]


def read_config(path) -> dict | None:
    """The config.json of directory `path` as a dict; None when it has none. A UserError
    when it is no JSON object."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        value = json.loads(config.read_bytes())
    except (ValueError, RecursionError) as e:  # bad JSON, not UTF-8, nested too deeply
        raise UserError(f"{config} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise UserError(
            f"{config} must hold a JSON object (a model config), not a {type(value).__name__}"
        )
    return value
