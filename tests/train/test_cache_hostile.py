"""`specdistill cache` and `target.cache` on hostile inputs: a shard size that is not a positive
number is refused before anything is written, and a damaged eval shard is refused by distill as
a damaged train shard is."""

import json
import shutil

import pytest

from specdistill import cli
from specdistill.train.config import RecipeError, load_recipe
from specdistill.train.target_cache import CacheError
from specdistill.train.target_cache_build import build_cache
from specdistill.train.trainer import Trainer
from tests.train.helpers import overrides


@pytest.fixture(scope="module")
def target_cache(tiny_pair, tmp_path_factory):
    """A target cache (top 8 of the tiny target's distributions) built once for the module."""
    out = tmp_path_factory.mktemp("cache") / "cache"
    recipe = load_recipe(None, overrides(tiny_pair, out.parent / "unused"))
    build_cache(recipe, out, top_n=8, print=lambda *a: None)
    splits = json.loads((out / "manifest.json").read_text())["splits"]
    assert splits["eval"]["shards"][0]["file"] == "eval-000000.safetensors"
    return out


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "x"])
def test_a_shard_size_that_is_not_positive_is_refused(tiny_pair, tmp_path, capsys, value):
    out = tmp_path / "cache"
    argv = ["cache", "--out", str(out), "--shard-mb", value, *overrides(tiny_pair, tmp_path / "u")]
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert f"argument --shard-mb: needs a finite number > 0; got '{value}'" in (
        capsys.readouterr().err
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "sizes, message",
    [
        ({"shard_bytes": 0}, "--shard-mb must give a shard size of at least 1 byte, got 0"),
        ({"batch_size": -1}, "--batch-size must be >= 1, got -1"),
    ],
)
def test_build_cache_refuses_sizes_below_one(tiny_pair, tmp_path, sizes, message):
    recipe = load_recipe(None, overrides(tiny_pair, tmp_path / "u"))
    with pytest.raises(CacheError, match=message):
        build_cache(recipe, tmp_path / "cache", top_n=8, print=lambda *a: None, **sizes)
    assert not (tmp_path / "cache").exists()


def test_an_out_that_is_a_file_is_refused_and_kept(tiny_pair, tmp_path):
    out = tmp_path / "cache"
    out.write_text("keep me")
    recipe = load_recipe(None, overrides(tiny_pair, tmp_path / "u"))
    with pytest.raises(CacheError, match=f"--out {out} exists and is not a directory"):
        build_cache(recipe, out, top_n=8, print=lambda *a: None)
    assert out.read_text() == "keep me"


def test_a_truncated_eval_shard_is_refused_before_training(tiny_pair, target_cache, tmp_path):
    damaged = tmp_path / "cache"
    shutil.copytree(target_cache, damaged)
    shard = damaged / "eval-000000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    run = tmp_path / "run"
    recipe = load_recipe(None, overrides(tiny_pair, run, **{"target.cache": str(damaged)}))
    match = r"eval-000000\.safetensors has \d+ bytes, the manifest \d+ \(truncated"
    with pytest.raises(RecipeError, match=match) as info:
        Trainer.from_recipe(recipe)
    assert "\n" not in str(info.value) and "rebuild the cache" in str(info.value)
    assert not (run / "metrics.jsonl").exists()
