"""Recipe files: a YAML file read into plain data, with the file and line that wrote each key,
and the parents it names in `extends:` read and merged under it.

    raw, sources, files = read_recipe(Path("recipes/smollm2-eagle3.yaml"))

`extends:` (top level only) names one recipe file or a list of them, each relative to the
file that names it, or a shipped recipe by name (`code`, `code.yaml`). Each parent is read
with its own parents first; then the parents are merged in order and the file itself last.
Merging goes key by key through the recipe's sections (train/recipe.py; `loss.params` too);
any other value (a scalar, a list, a mapping such as loss.temperature's) is replaced whole by
the later one. A loss parameter set flat (`loss.eta`) or under `loss.params` replaces the
other spelling of the same parameter. `extends` itself never reaches the schema.

A missing parent, a parent that is not a recipe (not a mapping, not YAML) and a cycle are
refused with one RecipeError line naming the file and line of the `extends` entry.
"""

from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

from specdistill.train.recipe import LossConfig, Recipe, Section
from specdistill.train.recipe_errors import RecipeError
from specdistill.train.recipe_types import sections_of

EXTENDS = "extends"
TOO_DEEP = "nested too deeply to read (lists or mappings inside each other)"


def section_keys(model: type[Section] = Recipe, prefix: str = "") -> set[str]:
    """The dotted keys whose value is a section (merged key by key), `loss.params` included;
    the draft section is one whatever its type."""
    keys = {"loss.params"} if model is Recipe else set()
    for name, field in model.model_fields.items():
        for section in sections_of(field.annotation):
            keys.add(f"{prefix}{name}")
            keys |= section_keys(section, f"{prefix}{name}.")
    return keys


SECTIONS = section_keys()


def shipped_names() -> list[str]:
    return sorted(p.stem for p in _shipped_dir().glob("*.yaml"))


def _shipped_dir() -> Path:
    return Path(str(files("specdistill.recipes")))


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a name the system cannot take (too long, a NUL byte)
        return False


def _shipped(path: Path) -> Path | None:
    """The shipped recipe (specdistill.recipes) a bare name such as `code` or `code.yaml`
    names; None when `path` is not a bare name or no such recipe ships."""
    name = path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml"
    shipped = _shipped_dir() / name
    return shipped if path.parent == Path(".") and path.name and _is_file(shipped) else None


def recipe_path(path: Path) -> Path:
    """`path` itself, or a shipped recipe when `path` is a bare name such as `code` or
    `code.yaml` and no such file exists here."""
    if path.is_file():
        return path
    shipped = _shipped(path)
    if shipped is None:
        raise RecipeError(
            f"recipe file not found: {path} (shipped recipes: {', '.join(shipped_names())})"
        )
    return shipped


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


def _extends_lines(root: yaml.Node) -> list[int]:
    """The line of each entry of the file's top-level `extends` (one for a single path)."""
    if not isinstance(root, yaml.MappingNode):
        return []
    for key_node, value_node in root.value:
        if key_node.value == EXTENDS:
            if isinstance(value_node, yaml.SequenceNode):
                return [item.start_mark.line + 1 for item in value_node.value]
            return [value_node.start_mark.line + 1]
    return []


def _text(path: Path) -> str:
    """The recipe file's text; RecipeError when it is not UTF-8 (UTF-16 named as such)."""
    # lazy: distill's parser imports this module; --help loads no torch
    from specdistill.data.records import utf8_text

    text = utf8_text(path.read_bytes(), path, RecipeError, "the recipe")
    return text.removeprefix("\ufeff")


def read_file(path: Path) -> tuple[dict, dict[str, int], list[int]]:
    """One recipe file as written: its mapping, the line of each key and the line of each
    `extends` entry (its parents are not read)."""
    text = _text(path)
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        lines = _key_lines(root)
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML ({e})") from None
    except _DuplicateKey as e:
        raise RecipeError(
            f"{path}:{e.line}: key {e.key!r} is written twice in one mapping (also at line "
            f"{e.first}); keep one"
        ) from None
    except RecursionError:
        raise RecipeError(f"{path}: {TOO_DEEP}") from None
    if raw is None:  # an empty file (or only comments): most likely not what was meant
        raise RecipeError(f"{path}: recipe is empty")
    if not isinstance(raw, dict):
        raise RecipeError(
            f"{path}: a recipe must be a mapping of sections, got {type(raw).__name__}"
        )
    return raw, lines, _extends_lines(root)


def read_recipe(path: Path) -> tuple[dict, dict[str, str], list[Path]]:
    """The recipe at `path` with its parents merged under it: (the data, dotted key ->
    'file:line' that wrote it, the files read in merge order)."""
    return _Reader().resolve(path, via=None)


class _Reader:
    """One resolution: the chain of files being read (a cycle is one that comes back) and
    every file read, in merge order."""

    def __init__(self):
        self.chain: list[tuple[Path, Path]] = []  # (resolved, as named)
        self.files: list[Path] = []

    def resolve(self, path: Path, via: str | None) -> tuple[dict, dict[str, str], list[Path]]:
        """`via`: 'file:line: extends NAME' of the entry that names `path` (None for the
        recipe itself), prefixed to the errors of reading `path`."""
        try:
            raw, lines, entry_lines = read_file(path)
        except RecipeError as e:
            raise e if via is None else RecipeError(f"{via}: {e}") from None
        own = {key: f"{path}:{line}" for key, line in lines.items() if not _in(key, EXTENDS)}
        if EXTENDS not in raw:
            self.files.append(path)
            return raw, own, self.files
        line = lines.get(EXTENDS, 1)
        entries = _entries(raw.pop(EXTENDS), f"{path}:{line}")
        if len(entry_lines) != len(entries):  # `extends` brought in by a YAML merge (<<)
            entry_lines = [line] * len(entries)
        self.chain.append((path.resolve(), path))
        merged: dict = {}
        merged_sources: dict[str, str] = {}
        for entry, entry_line in zip(entries, entry_lines, strict=True):
            where = f"{path}:{entry_line}: {EXTENDS} {entry!r}"
            parent = self.parent(entry, path, where)
            parent_raw, parent_sources, _ = self.resolve(parent, where)
            merge(merged, merged_sources, parent_raw, parent_sources)
        self.chain.pop()
        merge(merged, merged_sources, raw, own)
        self.files.append(path)
        return merged, merged_sources, self.files

    def parent(self, entry: str, child: Path, where: str) -> Path:
        """The file `entry` names: relative to `child`'s folder, else a shipped recipe."""
        named = Path(entry)
        try:
            named = named.expanduser()
        except RuntimeError:  # ~user of no such user: the name as written
            pass
        candidate = child.parent / named
        path = candidate if _is_file(candidate) else _shipped(named)
        if path is None:
            raise RecipeError(
                f"{where}: recipe file not found: {candidate} (shipped recipes: "
                f"{', '.join(shipped_names())})"
            )
        resolved = path.resolve()
        if any(seen == resolved for seen, _ in self.chain):
            start = next(i for i, (seen, _) in enumerate(self.chain) if seen == resolved)
            cycle = " -> ".join(str(named) for _, named in [*self.chain[start:], (None, path)])
            raise RecipeError(f"{where}: a cycle of extends ({cycle}); remove one of them")
        return path


def _entries(value: Any, where: str) -> list[str]:
    """`extends` as a list of paths; RecipeError at `where` when it is not one or a list."""
    entries = [value] if isinstance(value, str) else value
    if (
        not isinstance(entries, list)
        or not entries
        or not all(isinstance(e, str) and e.strip() for e in entries)
    ):
        raise RecipeError(
            f"{where}: {EXTENDS} must be a recipe file or a list of them (relative to this "
            f"file, or a shipped recipe's name), got {value!r}",
            key=EXTENDS,
        )
    return entries


def _in(key: str, prefix: str) -> bool:
    """`key` is `prefix` or a key under it."""
    return key == prefix or key.startswith(f"{prefix}.")


def _drop(sources: dict[str, str], key: str) -> None:
    for k in [k for k in sources if _in(k, key)]:
        del sources[k]


def _loss_params(loss: dict) -> set:
    """The loss parameters a `loss` mapping sets, flat or under `params`."""
    params = loss.get("params")
    flat = {k for k in loss if k not in LossConfig.model_fields}
    return flat | (set(params) if isinstance(params, dict) else set())


def merge(
    base: dict, base_sources: dict[str, str], top: dict, top_sources: dict[str, str], prefix=""
) -> None:
    """`top` merged into `base` in place (and its sources into `base_sources`): sections key
    by key, every other value replaced whole; `top` wins."""
    if prefix == "loss.":  # a parameter replaces the other spelling of itself
        params = base.get("params")
        for name in _loss_params(top):
            if name in base and name not in LossConfig.model_fields:
                del base[name]
                _drop(base_sources, f"loss.{name}")
            if isinstance(params, dict) and name in params:
                del params[name]
                _drop(base_sources, f"loss.params.{name}")
    for key, value in top.items():
        dotted = f"{prefix}{key}"
        old = base.get(key)
        if isinstance(value, dict) and isinstance(old, dict) and dotted in SECTIONS:
            if dotted in top_sources:
                base_sources[dotted] = top_sources[dotted]
            merge(old, base_sources, value, top_sources, f"{dotted}.")
            continue
        base[key] = value
        _drop(base_sources, dotted)
        base_sources.update({k: v for k, v in top_sources.items() if _in(k, dotted)})
