"""Recipes that extend others (`extends:`, train/recipe_files.py) and `specdistill recipe show`
(train/recipe_show.py): sections merge key by key, other values are replaced whole, later
parents win over earlier ones and the file over them all, overrides last; a cycle, a missing
parent or a parent that is not a recipe is one line naming the `extends` entry's file and line;
a bad value names the file and line that wrote it, a parent's too; `recipe show` names where
each value came from."""

import re
from pathlib import Path

import pytest
import yaml

from specdistill import cli
from specdistill.errors import one_line
from specdistill.train import distill
from specdistill.train.config import (
    RecipeError,
    load_recipe,
    recipe_to_dict,
    resolve_recipe,
)
from specdistill.train.recipe_show import render

REPO = Path(__file__).parents[2]


def files(tmp_path: Path, **texts: str) -> dict[str, Path]:
    """Each keyword a file `<name>.yaml` under tmp_path (`__` in a name: a folder)."""
    paths = {}
    for name, text in texts.items():
        path = tmp_path / f"{name.replace('__', '/')}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        paths[name] = path
    return paths


def at(path: Path, line: int) -> str:
    return re.escape(f"{path}:{line}: ")


# ----------------------------------------------------------------------------- merging


def test_sections_merge_key_by_key_and_the_file_wins(tmp_path):
    p = files(
        tmp_path,
        base="train:\n  max_steps: 7\n  lr: 2.0e-3\ndraft:\n  lora:\n    r: 8\n    alpha: 4\n",
        child="extends: base.yaml\ntrain:\n  max_steps: 9\ndraft:\n  lora:\n    alpha: 32\n",
    )
    recipe = load_recipe(p["child"])
    assert recipe.train.max_steps == 9  # the file's
    assert recipe.train.lr == 2e-3  # the parent's, beside it in the same section
    assert (recipe.draft.lora.r, recipe.draft.lora.alpha) == (8, 32)  # two sections down
    assert recipe.train.warmup_steps == 20  # set by neither: the default


def test_lists_scalars_and_mapping_values_are_replaced_whole(tmp_path):
    p = files(
        tmp_path,
        base="data:\n  train: [a.jsonl, b.jsonl]\n"
        "loss:\n  temperature: {0: 0.5, 1.0: 0.5}\n"
        "eval:\n  speculative:\n    gammas: [1, 2, 4, 8]\n"
        "target:\n  model: embedded:code\n",
        child="extends: base.yaml\ndata:\n  train: [c.jsonl]\n"
        "loss:\n  temperature: {0.7: 1.0}\n"
        "eval:\n  speculative:\n    gammas: [3]\n",
    )
    recipe = load_recipe(p["child"])
    assert recipe.data.train == ["c.jsonl"]
    assert recipe.loss.temperature == {0.7: 1.0}  # a value, not a section: not merged
    assert recipe.eval.speculative.gammas == [3]
    p["child"].write_text("extends: base.yaml\ndraft:\n  type: eagle3\n  model: null\n")
    assert load_recipe(p["child"]).draft.model is None  # null replaces the default too


def test_later_parents_override_earlier_ones_and_the_file_all(tmp_path):
    p = files(
        tmp_path,
        a="train:\n  max_steps: 1\n  lr: 1.0e-3\n  warmup_steps: 1\n",
        b="train:\n  max_steps: 2\n  lr: 2.0e-3\n",
        child="extends:\n  - a.yaml\n  - b.yaml\ntrain:\n  max_steps: 3\n",
    )
    resolved = resolve_recipe(p["child"])
    t = resolved.recipe.train
    assert (t.max_steps, t.lr, t.warmup_steps) == (3, 2e-3, 1)
    assert resolved.origin("train.max_steps") == f"{p['child']}:5"
    assert resolved.origin("train.lr") == f"{p['b']}:3"
    assert resolved.origin("train.warmup_steps") == f"{p['a']}:4"
    assert resolved.files == [p["a"], p["b"], p["child"]]
    p["child"].write_text("extends: [b.yaml, a.yaml]\n")
    assert load_recipe(p["child"]).train.lr == 1e-3  # the order decides


def test_overrides_apply_last(tmp_path):
    p = files(
        tmp_path,
        base="train:\n  max_steps: 7\n  seed: 3\n",
        child="extends: base.yaml\ntrain:\n  max_steps: 9\n",
    )
    resolved = resolve_recipe(p["child"], ["train.max_steps=11", "train.seed=5"])
    assert (resolved.recipe.train.max_steps, resolved.recipe.train.seed) == (11, 5)
    assert resolved.origin("train.max_steps") == "override"
    assert resolved.origin("train.lr") == "default"


def test_parents_are_found_relative_to_the_file_that_names_them(tmp_path):
    p = files(
        tmp_path,
        root="train:\n  lr: 5.0e-4\n",
        common__mid="extends: ../root.yaml\ntrain:\n  max_steps: 4\n",
        runs__child="extends: ../common/mid.yaml\ntrain:\n  seed: 2\n",
    )
    t = load_recipe(p["runs__child"]).train
    assert (t.lr, t.max_steps, t.seed) == (5e-4, 4, 2)


def test_a_shipped_recipe_is_a_parent_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = files(tmp_path / "mine", child="extends: code\ntrain:\n  max_steps: 3\n")
    resolved = resolve_recipe(p["child"])
    shipped = load_recipe("code")
    assert resolved.recipe.train.max_steps == 3
    assert resolved.recipe.acceptance_head == shipped.acceptance_head
    assert resolved.origin("train.save_every").endswith("code.yaml:" + _line("code", "save_every"))


def test_a_loss_parameter_replaces_its_other_spelling(tmp_path):
    p = files(
        tmp_path,
        nested="loss:\n  name: lk_lambda\n  params: {eta: 2.0}\n",
        flat="loss:\n  name: lk_lambda\n  eta: 2.0\n",
        child_flat="extends: nested.yaml\nloss:\n  eta: 4.0\n",
        child_nested="extends: flat.yaml\nloss:\n  params: {eta: 4.0}\n",
    )
    for child in ("child_flat", "child_nested"):
        resolved = resolve_recipe(p[child])
        assert resolved.recipe.loss.params == {"eta": 4.0}, child
        assert resolved.origin("loss.eta").startswith(f"{p[child]}:"), child


def test_a_parent_keeps_its_other_loss_parameters(tmp_path):
    p = files(
        tmp_path,
        base="loss:\n  name: jsd\n  beta: 0.25\n  top_k: 8\n",
        child="extends: base.yaml\nloss:\n  params: {beta: 0.75}\n",
    )
    assert load_recipe(p["child"]).loss.params == {"beta": 0.75, "top_k": 8}


# ----------------------------------------------------------------------------- refusals


def test_a_cycle_is_refused_naming_the_extends_entry(tmp_path):
    p = files(
        tmp_path,
        a="extends: b.yaml\ntrain:\n  max_steps: 2\n",
        b="train:\n  lr: 1.0e-3\nextends:\n  - a.yaml\n",
        me="extends: me.yaml\n",
    )
    with pytest.raises(RecipeError) as info:
        load_recipe(p["a"])
    message = str(info.value)
    assert re.match(rf"^{at(p['b'], 4)}extends 'a.yaml': a cycle of extends", message), message
    assert f"({p['a']} -> {p['b']} -> {p['a']})" in message and "\n" not in message
    with pytest.raises(RecipeError, match=rf"^{at(p['me'], 1)}extends 'me.yaml': a cycle"):
        load_recipe(p["me"])


def test_a_diamond_is_not_a_cycle(tmp_path):
    p = files(
        tmp_path,
        d="train:\n  seed: 4\n",
        b="extends: d.yaml\n",
        c="extends: d.yaml\n",
        a="extends: [b.yaml, c.yaml]\n",
    )
    assert load_recipe(p["a"]).train.seed == 4


def test_a_missing_parent_is_refused_naming_the_extends_entry(tmp_path):
    p = files(tmp_path, child="train:\n  max_steps: 2\nextends:\n  - a.yaml\n  - nope.yaml\n")
    (tmp_path / "a.yaml").write_text("train:\n  lr: 1.0e-3\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(p["child"])
    message = str(info.value)
    assert re.match(rf"^{at(p['child'], 5)}extends 'nope.yaml': recipe file not found: ", message)
    assert "shipped recipes: " in message and "\n" not in message


@pytest.mark.parametrize(
    "parent, problem",
    [
        ("- a\n- b\n", "a recipe must be a mapping of sections, got list"),
        ("# nothing\n", "recipe is empty"),
        ("train: [\n", "not valid YAML"),
        ("train:\n  lr: 1\n  lr: 2\n", "key 'lr' is written twice"),
    ],
)
def test_a_parent_that_is_not_a_recipe_is_refused_naming_the_extends_entry(
    tmp_path, parent, problem
):
    p = files(tmp_path, parent=parent, child="data:\n  max_length: 64\nextends: parent.yaml\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(p["child"])
    message = one_line(info.value)  # as `recipe error:` prints it
    assert message.startswith(f"{p['child']}:3: extends 'parent.yaml': {p['parent']}")
    assert problem in message


@pytest.mark.parametrize("value", ["3", "[]", "{a: b}", "[a.yaml, 2]", "null"])
def test_extends_must_name_files(tmp_path, value):
    p = files(tmp_path, child=f"train:\n  max_steps: 2\nextends: {value}\n")
    with pytest.raises(RecipeError, match=rf"^{at(p['child'], 3)}extends must be a recipe file"):
        load_recipe(p["child"])


def test_extends_never_reaches_the_schema(tmp_path):
    p = files(tmp_path, base="train:\n  seed: 1\n", child="extends: base.yaml\n")
    recipe = load_recipe(p["child"])
    assert "extends" not in recipe.model_dump() and recipe.train.seed == 1
    p["child"].write_text("train:\n  extends: base.yaml\n")  # only at the top level
    with pytest.raises(RecipeError, match=r"unknown recipe key 'train.extends'"):
        load_recipe(p["child"])
    with pytest.raises(RecipeError, match=r"extends is read from recipe files only"):
        load_recipe(p["base"], ["extends=other.yaml"])


# ------------------------------------------------------------- errors point at the writer


def test_a_bad_value_in_a_parent_names_the_parents_file_and_line(tmp_path):
    p = files(
        tmp_path,
        grand="eval:\n  every: 5\n  max_gamma: 0\n",
        base="extends: grand.yaml\ntrain:\n  max_steps: 0\n",
        child="extends: base.yaml\neval:\n  every: 3\n",
    )
    with pytest.raises(RecipeError, match=rf"^{at(p['base'], 3)}train.max_steps must be >= 1"):
        load_recipe(p["child"])
    with pytest.raises(RecipeError, match=rf"^{at(p['grand'], 3)}eval.max_gamma must be >= 1"):
        load_recipe(p["child"], ["train.max_steps=4"])
    assert load_recipe(p["child"], ["train.max_steps=4", "eval.max_gamma=2"]).eval.every == 3
    p["child"].write_text("extends: base.yaml\ntrain:\n  max_steps: -2\n")  # the file's own
    with pytest.raises(RecipeError, match=rf"^{at(p['child'], 3)}train.max_steps must be >= 1"):
        load_recipe(p["child"])


def test_an_unknown_key_in_a_parent_names_the_parents_file_and_line(tmp_path):
    p = files(
        tmp_path,
        base="train:\n  max_steps: 4\nloss:\n  name: jsd\n  bta: 0.3\n",
        child="extends: base.yaml\ntrian:\n  seed: 1\n",
    )
    with pytest.raises(RecipeError, match=rf"^{at(p['child'], 2)}unknown recipe key 'trian'"):
        load_recipe(p["child"])
    p["child"].write_text("extends: base.yaml\n")
    with pytest.raises(RecipeError, match=rf"^{at(p['base'], 5)}loss: jsd takes no parameter"):
        load_recipe(p["child"])


def test_an_extends_error_is_one_line_and_exit_2(tmp_path, capsys):
    p = files(tmp_path, child="extends: missing.yaml\n")
    assert distill.main(["--recipe", str(p["child"])]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"recipe error: {p['child']}:1: extends 'missing.yaml'")
    assert err.count("\n") == 1


# ----------------------------------------------------------------------------- recipe show


def by_key(text: str) -> dict[str, str]:
    """`recipe show`'s value lines by dotted key (the sections read from the indentation)."""
    found, path = {}, []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        key = line.strip().split(":")[0]
        path[depth:] = [key]
        if not line.endswith(":"):
            found[".".join(path)] = line
    return found


def test_recipe_show_names_where_each_value_came_from(tmp_path):
    p = files(
        tmp_path,
        base="train:\n  max_steps: 7\n  lr: 2.0e-3\nloss:\n  name: jsd\n  beta: 0.25\n",
        child="extends: base.yaml\ntrain:\n  max_steps: 9\n",
    )
    resolved = resolve_recipe(p["child"], ["train.seed=5"])
    text = render(resolved)
    assert yaml.safe_load(text) == recipe_to_dict(resolved.recipe)  # a loadable recipe
    lines = by_key(text)
    assert lines["train.max_steps"].endswith(f"# {p['child']}:3")
    assert lines["train.lr"].endswith(f"# {p['base']}:3")
    assert lines["loss.beta"].endswith(f"# {p['base']}:6")
    assert lines["train.seed"].endswith("# override")
    assert lines["train.warmup_steps"].endswith("# default")
    assert lines["acceptance_head.lr"].endswith("# default")
    assert text.startswith(f"# resolved from {p['base']}, {p['child']}\n# overrides: train.seed\n")
    for line in text.splitlines():  # every value names its origin; a section line none
        assert line.startswith("#") or line.endswith(":") or re.search(r"  # \S+$", line), line


def test_recipe_show_is_a_verb(tmp_path, capsys):
    p = files(tmp_path, child="extends: code\ntrain:\n  max_steps: 3\n")
    assert cli.main(["recipe", "show", str(p["child"]), "train.seed=2"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"  max_steps: 3 +# {re.escape(str(p['child']))}:3\n", out)
    assert re.search(r"  seed: 2 +# override\n", out)
    assert re.search(r"  save_every: 50 +# \S*code\.yaml:\d+\n", out)
    assert cli.main(["recipe", "show", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err.startswith("recipe error: recipe file not found: ")


def test_recipe_show_of_a_shipped_recipe_names_its_base():
    resolved = resolve_recipe(REPO / "recipes" / "smollm2-eagle3.yaml")
    text = render(resolved)
    base = f"{REPO / 'recipes' / 'smollm2-base.yaml'}:"
    child = f"{REPO / 'recipes' / 'smollm2-eagle3.yaml'}:"
    assert re.search(rf"  model: registry:smollm2-135m-instruct +# {re.escape(base)}\d+\n", text)
    assert re.search(rf"  type: eagle3 +# {re.escape(child)}\d+\n", text)
    assert re.search(r"  ttt_steps: 3 +# default\n", text)


# ----------------------------------------------------------------------------- shipped


FAMILIES = {
    "code.yaml": ["code-4layer.yaml", "code-eagle3.yaml", "code-parallel.yaml"],
    "smollm2-base.yaml": [
        "smollm2-standalone.yaml",
        "smollm2-eagle3.yaml",
        "smollm2-parallel.yaml",
    ],
}


@pytest.mark.parametrize("base, child", [(b, c) for b, cs in FAMILIES.items() for c in cs])
def test_shipped_recipes_extend_their_base(base, child, tmp_path, monkeypatch):
    resolved = resolve_recipe(REPO / "recipes" / child)
    assert resolved.files == [REPO / "recipes" / base, REPO / "recipes" / child]
    inherited = "target.model" if base == "smollm2-base.yaml" else "train.max_steps"
    assert resolved.origin(inherited).startswith(f"{REPO / 'recipes' / base}:")
    assert resolved.origin("train.output_dir").startswith(f"{REPO / 'recipes' / child}:")
    monkeypatch.chdir(tmp_path)  # by name, from anywhere: the parent is found beside it
    assert load_recipe(child.removesuffix(".yaml")) == resolved.recipe


def test_the_smollm2_base_is_marked_as_a_base():
    header = (REPO / "recipes" / "smollm2-base.yaml").read_text().split("\ntarget:")[0]
    assert "A base, not a run of its own" in header
    assert load_recipe(REPO / "recipes" / "smollm2-base.yaml").train.output_dir == (
        "runs/smollm2-base"
    )


def test_the_training_guide_shows_what_the_code_does(tmp_path, monkeypatch):
    """docs/training.md's `extends:` example loads, and its `recipe show` lines are the
    command's output."""
    guide = (REPO / "docs" / "training.md").read_text()
    section = guide.split("### A recipe that extends another")[1]
    example, shown = re.findall(r"```yaml\n(.*?)```", section, re.S)[:2]
    p = files(tmp_path, mine=example)
    recipe = load_recipe(p["mine"])
    assert (recipe.loss.name, recipe.train.max_steps, recipe.train.save_every) == ("tv", 300, 50)
    monkeypatch.chdir(REPO)
    command = re.search(r"specdistill recipe show (\S+) (\S+)", section)
    out = render(resolve_recipe(command[1], [command[2]]))
    for line in shown.splitlines():
        assert line == "..." or line in out.splitlines(), line


def _line(name: str, key: str) -> str:
    """The line of `key:` in the shipped recipe `name`."""
    text = (REPO / "recipes" / f"{name}.yaml").read_text().splitlines()
    return str(next(i for i, line in enumerate(text, 1) if line.strip().startswith(f"{key}:")))
