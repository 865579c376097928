"""`specdistill prepare` (train/prepare.py): one command makes a recipe's training and held-out
answers, a rerun answers nothing again, the output trains, and a recipe whose prepared
directories feed nothing is refused before anything loads."""

import json

import pytest

from specdistill.train import prepare as prepare_verb
from specdistill.train.config import load_recipe
from specdistill.train.recipe_errors import RecipeError
from tests.train.helpers import overrides, prepare_overrides, read_answers


def test_prepare_answers_both_sets_once_and_the_recipe_trains(tiny_pair, tmp_path):
    argv = prepare_overrides(tiny_pair, tmp_path)
    lines = []
    results = prepare_verb.prepare(load_recipe(None, argv), batch_size=4, print=lines.append)
    by_name = {r.name: r for r in results}
    assert by_name["train"].prompts == 6 and by_name["train"].answered == 6  # the limit
    assert by_name["eval"].prompts == 10 and by_name["eval"].complete  # f10..f19
    train = read_answers(tmp_path / "answers")
    assert len(train) == 6 and len(read_answers(tmp_path / "heldout")) == 10
    assert by_name["train"].tokens == sum(r["completion_tokens"] for r in train) > 0
    manifest = json.loads((tmp_path / "answers" / "manifest.json").read_text())
    assert manifest["sampling"]["max_new_tokens"] == 5 and manifest["complete"]

    again = prepare_verb.prepare(load_recipe(None, argv), batch_size=4, print=lines.append)
    assert [r.answered for r in again] == [6, 10]
    assert read_answers(tmp_path / "answers") == train  # nothing answered twice

    assert prepare_verb.main(argv) == 0  # the verb: everything answered, exit 0


def test_distill_trains_on_the_preparedread_answers(tiny_pair, tmp_path):
    from specdistill.train.distill import main as distill

    argv = prepare_overrides(tiny_pair, tmp_path, **{"train.max_steps": 2})
    prepare_verb.prepare(load_recipe(None, argv), batch_size=4, print=lambda *a: None)
    assert distill(argv) == 0
    assert (tmp_path / "run" / "final").is_dir()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"prepare.train.out": "null"}, "set prepare.train.out too"),
        ({"prepare.eval.out": "/elsewhere"}, "is not read by data.eval"),
    ],
)
def test_a_prepared_set_that_feeds_nothing_is_refused(tiny_pair, tmp_path, extra, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(None, prepare_overrides(tiny_pair, tmp_path, **extra))


def test_a_recipe_without_a_prepare_section_says_what_to_set(tiny_pair, tmp_path):
    recipe = load_recipe(None, overrides(tiny_pair, tmp_path / "run"))
    with pytest.raises(prepare_verb.PrepareError, match="prepare.train.prompts"):
        prepare_verb.prepare(recipe, print=lambda *a: None)


def test_prepare_builds_the_teacher_outputs_a_cached_recipe_trains_on(tiny_pair, tmp_path):
    """With target.cache set, prepare writes the target's outputs over the training answers
    after answering them (over the draft's own columns for a reduced vocabulary), keeps them
    on a rerun, rebuilds them when the data changed, and distill trains from them."""
    from specdistill.train.distill import main as distill
    from specdistill.train.target_cache_vocab import cache_columns

    cache = tmp_path / "cache"
    extra = {
        "draft.model": "target-layers:1",
        "draft.vocab_size": 50,
        "target.cache": str(cache),
        "train.max_steps": 2,
    }
    argv = prepare_overrides(tiny_pair, tmp_path, **extra)
    lines = []
    prepare_verb.prepare(load_recipe(None, argv), batch_size=4, print=lines.append)
    assert cache_columns(cache) == "draft"
    manifest = json.loads((cache / "manifest.json").read_text())
    assert list(manifest["splits"]) == ["train"] and manifest["top_n"] == 50
    assert any("MiB in" in line for line in lines)
    built = (cache / "manifest.json").stat().st_mtime_ns

    prepare_verb.prepare(load_recipe(None, argv), batch_size=4, print=lines.append)
    assert (cache / "manifest.json").stat().st_mtime_ns == built
    assert any("serve this data: kept" in line for line in lines)

    more = prepare_overrides(tiny_pair, tmp_path, **extra, **{"prepare.train.limit": 8})
    prepare_verb.prepare(load_recipe(None, more), batch_size=4, print=lines.append)
    assert any(line.startswith(f"prepare: rebuilding {cache}") for line in lines)
    assert distill(more) == 0
