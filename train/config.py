"""Recipes: YAML files read into the recipe schema (train/recipe.py), with `key.sub=value`
overrides.

    recipe = load_recipe("recipes/code.yaml", ["train.max_steps=50", "loss.name=tv"])

A recipe file may name parents (`extends:`), read and merged under it by
train/recipe_files.py; the overrides apply last. Unknown keys and bad values raise
`RecipeError` with a one-line message that names the key (and, for a key a file sets, the
file and line that set it, a parent's when the parent set it), the value and the fix.
`resolve_recipe` also says where each value came from (`specdistill recipe show`).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from specdistill.train.recipe import (
    DataConfig,
    EvalConfig,
    LossConfig,
    OnlineConfig,
    OnPolicyConfig,
    Recipe,
    SpeculativeEvalConfig,
    TargetConfig,
    TrainConfig,
    WandbConfig,
    harmless_keys,
)
from specdistill.train.recipe_checks import validate
from specdistill.train.recipe_draft import (
    DraftConfig,
    DraftSection,
    Eagle3Draft,
    LoraConfig,
    ParallelDraft,
    StandaloneDraft,
    draft_section,
    own_keys,
)
from specdistill.train.recipe_errors import RecipeError, translate
from specdistill.train.recipe_files import EXTENDS, TOO_DEEP, read_recipe, recipe_path
from specdistill.train.recipe_types import (
    RESUME_VALUES,
    DepthWeighting,
    DraftType,
    Dtype,
    MixedPrecision,
    OnPolicySource,
    WandbMode,
)

__all__ = [
    "RESUME_VALUES",
    "DataConfig",
    "DepthWeighting",
    "DraftConfig",
    "DraftSection",
    "DraftType",
    "Dtype",
    "Eagle3Draft",
    "EvalConfig",
    "LoraConfig",
    "LossConfig",
    "MixedPrecision",
    "OnPolicyConfig",
    "OnPolicySource",
    "OnlineConfig",
    "ParallelDraft",
    "Recipe",
    "RecipeError",
    "ResolvedRecipe",
    "SpeculativeEvalConfig",
    "StandaloneDraft",
    "TargetConfig",
    "TrainConfig",
    "WandbConfig",
    "WandbMode",
    "draft_section",
    "dump_recipe",
    "harmless_keys",
    "load_recipe",
    "load_run_recipe",
    "own_keys",
    "parse_override",
    "recipe_datasets",
    "recipe_from_dict",
    "recipe_to_dict",
    "resolve_recipe",
    "validate",
]


def recipe_from_dict(raw: dict) -> Recipe:
    """A checked Recipe from plain data (sections of keys, loss parameters flat or under
    `params`); RecipeError names the first problem."""
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe must be a mapping of sections, got {raw!r}")
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as e:
        raise translate(e, Recipe) from None
    validate(recipe)
    return recipe


def recipe_to_dict(recipe: Recipe) -> dict:
    """The recipe as plain data, loadable again: the draft section holds its type's keys only;
    the loss parameters are written flat."""
    d = recipe.model_dump()
    d["loss"] = {**{k: v for k, v in d["loss"].items() if k != "params"}, **d["loss"]["params"]}
    return d


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise RecipeError(f"cannot set '{key}': '{part}' is not a section")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`train.max_steps=50` -> ("train.max_steps", 50); the value is parsed as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise RecipeError(
            f"override {text!r} must look like key.sub=value (e.g. train.max_steps=50)"
        )
    try:
        return key.strip(), yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as e:
        raise RecipeError(f"override {text!r}: value is not valid YAML ({e})") from None
    except RecursionError:
        raise RecipeError(f"override {key.strip()}=...: {TOO_DEEP}") from None


def _overridden(key: str, overridden: list[str]) -> bool:
    """An override set `key`, a section holding it or a key inside it."""
    return any(key == o or key.startswith(f"{o}.") or o.startswith(f"{key}.") for o in overridden)


def _candidates(key: str) -> list[str]:
    """`key`, and for a loss parameter its other spelling (flat first: it wins)."""
    if key.startswith("loss.params."):
        return ["loss." + key.removeprefix("loss.params."), key]
    if key.startswith("loss."):
        return [key, "loss.params." + key.removeprefix("loss.")]
    return [key]


def _given(raw: dict, key: str) -> bool:
    """`key` (dotted) is written in `raw`: by a recipe file or an override, not defaulted."""
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


@dataclass
class ResolvedRecipe:
    """A recipe and where each of its values came from.

    raw: the data validated (the files merged, the overrides applied); sources: dotted key
    -> 'file:line' of the recipe file (or parent) that wrote it; overridden: the keys the
    overrides set; files: the recipe files read, parents first."""

    recipe: Recipe
    raw: dict
    sources: dict[str, str]
    overridden: list[str]
    files: list[Path]

    def origin(self, key: str) -> str:
        """'file:line', 'override' or 'default': what set the value of `key`."""
        return _origin(key, self.raw, self.sources, self.overridden) or "default"


def _origin(key: str, raw: dict, sources: dict[str, str], overridden: list[str]) -> str | None:
    for candidate in _candidates(key):
        if _given(raw, candidate):
            if _overridden(candidate, overridden):
                return "override"
            return _line(candidate, sources)
    return None


def _line(key: str, sources: dict[str, str]) -> str | None:
    """'file:line' that wrote `key`; else that of the nearest section holding it (a key a
    YAML merge `<<` brought in, a check about a whole section)."""
    for candidate in _candidates(key):
        if candidate in sources:
            return sources[candidate]
    while key := key.rpartition(".")[0]:
        if key in sources:
            return sources[key]
    return None


def _where(key: str | None, sources: dict[str, str], overridden: list[str]) -> str:
    """'file:line: ' when `key` is written in a recipe file (not by an override)."""
    if key is None:
        return ""
    key = key.split("[", 1)[0]
    if _overridden(key, overridden):
        return ""
    line = _line(key, sources)
    return f"{line}: " if line else ""


def resolve_recipe(path: str | Path | None, overrides: list[str] = ()) -> ResolvedRecipe:
    """`load_recipe`, with where each value came from (`specdistill recipe show`)."""
    raw: dict = {}
    sources: dict[str, str] = {}
    files: list[Path] = []
    if path is not None:
        raw, sources, files = read_recipe(recipe_path(Path(path)))
    overridden = []
    for text in overrides:
        key, value = parse_override(text)
        if key.split(".", 1)[0] == EXTENDS:
            raise RecipeError(
                f"override {text!r}: {EXTENDS} is read from recipe files only; write it in "
                "the recipe"
            )
        _set_dotted(raw, key, value)
        overridden.append(key)
    try:
        recipe = recipe_from_dict(raw)
    except RecipeError as e:
        where = _where(e.key, sources, overridden)
        if not where:
            raise
        raise RecipeError(f"{where}{e}", key=e.key) from None
    return ResolvedRecipe(recipe, raw, sources, overridden, files)


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> Recipe:
    """Read a YAML recipe (or start from defaults when `path` is None) and apply overrides:
    the recipe's parents (`extends:`) first, the file itself over them, the overrides last."""
    return resolve_recipe(path, overrides).recipe


def recipe_datasets(recipe: Recipe, tokenizer):
    """(train, eval) TokenDatasets of the recipe's `data` section, as the trainer sees them
    (the target cache must see the very same sequences)."""
    # lazy: distill's parser imports this module; --help loads no torch
    from specdistill.data import build_datasets

    d = recipe.data
    return build_datasets(
        tokenizer,
        d.train,
        d.eval,
        max_length=d.max_length,
        pack=d.pack,
        eval_fraction=d.eval_fraction,
        skip_malformed=d.skip_malformed,
        seed=recipe.train.seed,
    )


# Keys a run's recipe.yaml held for every draft type before the draft section was one per type
# (`dump_recipe` wrote draft.parallel_depths for a standalone draft and an EAGLE-3 head too).
UNIFORM_DRAFT_KEYS = ("parallel_depths",)


def load_run_recipe(path: str | Path) -> Recipe:
    """A run's recipe.yaml (`dump_recipe`), as `load_recipe` reads it; one a run wrote before
    the draft section was one per type holds `UNIFORM_DRAFT_KEYS` for every type: dropped
    where the type has no such key."""
    raw, sources, _ = read_recipe(recipe_path(Path(path)))
    draft = raw.get("draft")
    if isinstance(draft, dict) and isinstance(draft.get("type"), str):
        own = own_keys().get(draft["type"], set())
        for name in UNIFORM_DRAFT_KEYS:
            if f"draft.{name}" not in own:
                draft.pop(name, None)
    try:
        return recipe_from_dict(raw)
    except RecipeError as e:
        where = _where(e.key, sources, [])
        raise RecipeError(f"{where}{e}", key=e.key) from None


def dump_recipe(recipe: Recipe, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
