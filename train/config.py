"""Recipes: YAML files read into the recipe schema (train/recipe.py), with `key.sub=value`
overrides.

    recipe = load_recipe("recipes/code.yaml", ["train.max_steps=50", "loss.name=tv"])

Unknown keys and bad values raise `RecipeError` with a one-line message that names the key
(and, for a key the file sets, the file and line), the value and the fix.
"""

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from specdistill.train.recipe import (
    EAGLE3_KEYS,
    DataConfig,
    DraftConfig,
    EvalConfig,
    LoraConfig,
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
from specdistill.train.recipe_errors import RecipeError, translate
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
    "EAGLE3_KEYS",
    "RESUME_VALUES",
    "DataConfig",
    "DepthWeighting",
    "DraftConfig",
    "DraftType",
    "Dtype",
    "EvalConfig",
    "LoraConfig",
    "LossConfig",
    "MixedPrecision",
    "OnPolicyConfig",
    "OnPolicySource",
    "OnlineConfig",
    "Recipe",
    "RecipeError",
    "SpeculativeEvalConfig",
    "TargetConfig",
    "TrainConfig",
    "WandbConfig",
    "WandbMode",
    "dump_recipe",
    "harmless_keys",
    "load_recipe",
    "parse_override",
    "recipe_datasets",
    "recipe_from_dict",
    "recipe_to_dict",
    "validate",
]


_TOO_DEEP = "nested too deeply to read (lists or mappings inside each other)"


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
    """The recipe as plain data, loadable again: a draft type without the EAGLE-3 head keys
    leaves them out (setting them is an error there); the loss parameters are written flat."""
    from specdistill import drafts

    d = recipe.model_dump()
    if not drafts.planned(recipe.draft).capabilities.eagle3_keys:
        for key in EAGLE3_KEYS:
            d["draft"].pop(key.removeprefix("draft."))
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
        raise RecipeError(f"override {key.strip()}=...: {_TOO_DEEP}") from None


def _recipe_path(path: Path) -> Path:
    """`path` itself, or a shipped recipe (specdistill.recipes) when `path` is a bare name
    such as `code` or `code.yaml` and no such file exists here."""
    if path.is_file():
        return path
    from importlib.resources import files

    shipped = Path(str(files("specdistill.recipes")))
    name = path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml"
    if path.parent == Path(".") and (shipped / name).is_file():
        return shipped / name
    names = sorted(p.stem for p in shipped.glob("*.yaml"))
    raise RecipeError(f"recipe file not found: {path} (shipped recipes: {', '.join(names)})")


class _DuplicateKey(Exception):
    """A mapping of the recipe file that writes one key twice (`line`, `first`: 1-based)."""

    def __init__(self, key, line: int, first: int):
        super().__init__(key, line, first)
        self.key, self.line, self.first = key, line, first


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key written twice in one mapping is an error
    (`_DuplicateKey`) rather than silently the last value. Keys a merge (`<<`) brings in
    may still be overridden, as YAML intends."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: PyYAML's own error follows
                    continue
                if first is not key_node:
                    line = key_node.start_mark.line + 1
                    raise _DuplicateKey(key, line, first.start_mark.line + 1)
        return super().construct_mapping(node, deep)


def _key_lines(node: yaml.Node, prefix: str = "") -> dict[str, int]:
    """Dotted key -> the 1-based line of the YAML file that writes it."""
    lines = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            lines[key] = key_node.start_mark.line + 1
            lines.update(_key_lines(value_node, f"{key}."))
    return lines


def _text(path: Path) -> str:
    """The recipe file's text; RecipeError when it is not UTF-8 (UTF-16 named as such)."""
    from specdistill.data.records import utf8_text

    text = utf8_text(path.read_bytes(), path, RecipeError, "the recipe")
    return text.removeprefix("\ufeff")


def _read(path: Path) -> tuple[dict, dict[str, int]]:
    """The recipe file's mapping and the line of each key."""
    text = _text(path)
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
        lines = _key_lines(yaml.compose(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML ({e})") from None
    except _DuplicateKey as e:
        raise RecipeError(
            f"{path}:{e.line}: key {e.key!r} is written twice in one mapping (also at line "
            f"{e.first}); keep one"
        ) from None
    except RecursionError:
        raise RecipeError(f"{path}: {_TOO_DEEP}") from None
    if raw is None:  # an empty file (or only comments): most likely not what was meant
        raise RecipeError(f"{path}: recipe is empty")
    if not isinstance(raw, dict):
        raise RecipeError(
            f"{path}: a recipe must be a mapping of sections, got {type(raw).__name__}"
        )
    return raw, lines


def _where(key: str | None, path: Path | None, lines: dict, overridden: list[str]) -> str:
    """'file:line: ' when `key` is written in the recipe file (not by an override)."""
    if key is None or path is None:
        return ""
    key = key.split("[", 1)[0]
    if any(key == o or key.startswith(f"{o}.") or o.startswith(f"{key}.") for o in overridden):
        return ""
    candidates = [key]
    if key.startswith("loss.") and not key.startswith("loss.params."):
        candidates.append("loss.params." + key.removeprefix("loss."))
    for candidate in candidates:
        while candidate:
            if candidate in lines:
                return f"{path}:{lines[candidate]}: "
            candidate = candidate.rpartition(".")[0]
    return ""


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> Recipe:
    """Read a YAML recipe (or start from defaults when `path` is None) and apply overrides."""
    raw: dict = {}
    lines: dict[str, int] = {}
    if path is not None:
        path = _recipe_path(Path(path))
        raw, lines = _read(path)
    overridden = []
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(raw, key, value)
        overridden.append(key)
    try:
        return recipe_from_dict(raw)
    except RecipeError as e:
        where = _where(e.key, path, lines, overridden)
        if not where:
            raise
        raise RecipeError(f"{where}{e}", key=e.key) from None


def recipe_datasets(recipe: Recipe, tokenizer):
    """(train, eval) TokenDatasets of the recipe's `data` section, as the trainer sees them
    (the target cache must see the very same sequences)."""
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


def dump_recipe(recipe: Recipe, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
