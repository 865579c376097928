"""The recipe's draft section, one per draft type (train/recipe_draft.py): `draft.type` picks
the section, a key of another type and an unknown type are refused in one line, and each
type's section goes through dump and load unchanged."""

import pytest
import yaml

from specdistill.train import recipe_show
from specdistill.train.config import (
    DraftSection,
    Eagle3Draft,
    ParallelDraft,
    RecipeError,
    StandaloneDraft,
    draft_section,
    dump_recipe,
    load_recipe,
    load_run_recipe,
    recipe_to_dict,
    resolve_recipe,
)

EAGLE3 = ["draft.type=eagle3", "draft.model=null"]


def refusal(overrides: list[str], path=None) -> str:
    with pytest.raises(RecipeError) as refused:
        load_recipe(path, overrides)
    message = str(refused.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "overrides, section",
    [
        ([], StandaloneDraft),
        (["draft.type=standalone"], StandaloneDraft),
        ([*EAGLE3, "draft.ttt_steps=2"], Eagle3Draft),
        (["draft.type=parallel", "draft.parallel_depths=3"], ParallelDraft),
    ],
)
def test_the_type_picks_the_section(overrides, section):
    draft = load_recipe(None, overrides).draft
    assert type(draft) is section and isinstance(draft, DraftSection)


def test_a_key_of_another_type_names_the_key_the_type_and_the_type_that_has_it():
    assert refusal(["draft.ttt_steps=3"]) == (
        "draft.ttt_steps apply to draft.type=eagle3 only, not draft.type=standalone"
    )
    assert refusal([*EAGLE3, "draft.parallel_depths=4"]) == (
        "draft.parallel_depths apply to draft.type=parallel only, not draft.type=eagle3"
    )
    assert refusal(["draft.type=parallel", "draft.freeze_lm_head=true"]) == (
        "draft.freeze_lm_head apply to draft.type=eagle3 only, not draft.type=parallel"
    )
    assert refusal(["draft.parallel_depths=2", "draft.ttt_steps=2"]) == (  # in written order
        "draft.parallel_depths apply to draft.type=parallel only, draft.ttt_steps apply to "
        "draft.type=eagle3 only, not draft.type=standalone"
    )


def test_a_key_of_another_type_in_a_file_names_its_line(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("draft:\n  type: parallel\n  ttt_steps: 2\n")
    assert refusal([], path) == (
        f"{path}:3: draft.ttt_steps apply to draft.type=eagle3 only, not draft.type=parallel"
    )


def test_an_unknown_type_lists_the_types():
    assert refusal(["draft.type=eagle"]) == (
        "draft.type must be one of standalone, eagle3, parallel, got 'eagle'; "
        "did you mean 'eagle3'?"
    )
    # its own keys do not hide it: the type is what is wrong
    assert refusal(["draft.type=medusa", "draft.ttt_steps=2"]).startswith(
        "draft.type must be one of standalone, eagle3, parallel, got 'medusa'"
    )


def test_other_errors_inside_a_section_name_the_recipe_key():
    assert refusal([*EAGLE3, "draft.ttt_steps=0"]) == "draft.ttt_steps must be >= 1, got 0"
    assert refusal(["draft.modle=x"]) == (
        "unknown recipe key 'draft.modle'; did you mean 'draft.model'?"
    )
    assert refusal(["draft.lora.r=-1"]) == "draft.lora.r must be >= 0, got -1"
    assert refusal(["draft=3"]) == "draft must be a mapping, got 3"


def test_overrides_change_the_type_of_a_shipped_recipe_before_validation():
    recipe = load_recipe("code", [*EAGLE3, "draft.ttt_steps=2"])
    assert type(recipe.draft) is Eagle3Draft and recipe.draft.ttt_steps == 2
    assert recipe.draft.vocab_size is None  # the common keys as the file left them
    # a file's own keys of one type stay its: another type is refused, naming them
    assert refusal(["draft.type=parallel"], "code-eagle3").endswith(
        "draft.intermediate_size apply to draft.type=eagle3 only, not draft.type=parallel"
    )


@pytest.mark.parametrize(
    "overrides, own",
    [
        (["draft.lora.r=4"], {}),
        (
            [*EAGLE3, "draft.ttt_steps=5", "draft.aux_layers=[0, 2]", "draft.freeze_lm_head=true"],
            {"ttt_steps": 5, "aux_layers": [0, 2], "freeze_lm_head": True},
        ),
        (["draft.type=parallel", "draft.parallel_depths=6"], {"parallel_depths": 6}),
    ],
    ids=["standalone", "eagle3", "parallel"],
)
def test_each_section_round_trips_through_dump_and_load(tmp_path, overrides, own):
    recipe = load_recipe(None, overrides)
    dump_recipe(recipe, tmp_path / "recipe.yaml")
    written = yaml.safe_load((tmp_path / "recipe.yaml").read_text())["draft"]
    kind = recipe.draft.type
    others = {"eagle3": {"ttt_steps", "aux_layers"}, "parallel": {"parallel_depths"}}
    assert not {k for t, keys in others.items() if t != kind for k in keys} & set(written)
    assert {k: written[k] for k in own} == own
    assert load_recipe(tmp_path / "recipe.yaml") == recipe
    assert load_run_recipe(tmp_path / "recipe.yaml") == recipe


def test_a_run_recipe_written_with_every_types_keys_still_loads(tmp_path):
    """A run's recipe.yaml from before the per-type section held draft.parallel_depths for
    every type: a resumed run reads it as the recipe it was; a recipe file may not."""
    d = recipe_to_dict(load_recipe(None))
    d["draft"]["parallel_depths"] = 4
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(d, sort_keys=False))
    assert load_run_recipe(tmp_path / "recipe.yaml") == load_recipe(None)
    with pytest.raises(RecipeError, match="parallel_depths apply to draft.type=parallel only"):
        load_recipe(tmp_path / "recipe.yaml")


def test_extends_merges_the_draft_section_key_by_key(tmp_path):
    (tmp_path / "base.yaml").write_text("draft:\n  type: eagle3\n  model: null\n")
    (tmp_path / "r.yaml").write_text("extends: base.yaml\ndraft:\n  ttt_steps: 4\n")
    draft = load_recipe(tmp_path / "r.yaml").draft
    assert type(draft) is Eagle3Draft and draft.ttt_steps == 4 and draft.model is None


def test_recipe_show_prints_the_types_own_keys_only():
    eagle3 = recipe_show.render(resolve_recipe("code-eagle3", ["draft.ttt_steps=2"]))
    assert "ttt_steps: 2" in eagle3 and "# override" in eagle3
    assert "parallel_depths" not in eagle3
    shown = recipe_show.render(resolve_recipe("code", []))
    assert "ttt_steps" not in shown and "parallel_depths" not in shown


def test_a_section_outside_a_recipe_is_checked_as_in_one():
    assert type(draft_section({"type": "eagle3", "model": None})) is Eagle3Draft
    assert Eagle3Draft(model=None).type == "eagle3"  # built in code: its own type
    with pytest.raises(RecipeError, match=r"^draft.ttt_steps apply to draft.type=eagle3 only"):
        draft_section({"type": "standalone", "ttt_steps": 2})
