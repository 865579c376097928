"""A damaged target cache (truncated, swapped, renamed shards) is refused by `distill` before
it writes anything, with one line naming the shard."""

import json
import shutil

import pytest

from specdistill.train.config import RecipeError, load_recipe
from specdistill.train.target_cache_build import build_cache
from specdistill.train.trainer import Trainer
from tests.train.helpers import overrides


@pytest.fixture(scope="module")
def sharded_cache(tiny_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded") / "cache"
    recipe = load_recipe(None, overrides(tiny_pair, out.parent / "unused"))
    build_cache(recipe, out, top_n=8, shard_bytes=3000, print=lambda *a: None)
    shards = json.loads((out / "manifest.json").read_text())["splits"]["train"]["shards"]
    assert len(shards) >= 3
    return out


def _damaged(sharded_cache, tmp_path, damage) -> tuple:
    cache = tmp_path / "cache"
    shutil.copytree(sharded_cache, cache)
    damage(cache)
    return cache


def _truncate(cache):
    path = cache / "train-000001.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def _swap(cache):
    a, b = cache / "train-000000.safetensors", cache / "train-000001.safetensors"
    a.rename(cache / "x")
    b.rename(a)
    (cache / "x").rename(b)


def _same_size_swap(cache):
    """Another shard's bytes under this one's name, the manifest's size matching."""
    manifest = json.loads((cache / "manifest.json").read_text())
    shards = manifest["splits"]["train"]["shards"]
    shutil.copy(cache / shards[2]["file"], cache / shards[1]["file"])
    shards[1].update(bytes=shards[2]["bytes"], rows=shards[2]["rows"])
    shards[1]["sequences"] = shards[2]["sequences"]
    (cache / "manifest.json").write_text(json.dumps(manifest))


def _garbage_header(cache):
    path = cache / "train-000000.safetensors"
    size = path.stat().st_size
    path.write_bytes(b"\xff" * size)


@pytest.mark.parametrize(
    "damage, message",
    [
        (_truncate, r"train-000001\.safetensors has \d+ bytes, the manifest \d+ \(truncated"),
        (_swap, r"train-00000[01]\.safetensors (has \d+ bytes|was written as first_sequence)"),
        (_same_size_swap, r"train-000001\.safetensors was written as first_sequence \d+"),
        (_garbage_header, r"train-000000\.safetensors cannot be read"),
    ],
)
def test_a_damaged_shard_is_refused_before_anything_is_written(
    tiny_pair, sharded_cache, tmp_path, damage, message
):
    cache = _damaged(sharded_cache, tmp_path, damage)
    run = tmp_path / "run"
    recipe = load_recipe(None, overrides(tiny_pair, run, **{"target.cache": str(cache)}))
    with pytest.raises(RecipeError, match=message) as info:
        Trainer.from_recipe(recipe)
    assert "\n" not in str(info.value) and "rebuild the cache" in str(info.value)
    for name in ("metrics.jsonl", "recipe.yaml", "tau_texts.json"):
        assert not (run / name).exists()


def test_an_intact_sharded_cache_is_accepted(tiny_pair, sharded_cache, tmp_path):
    recipe = load_recipe(
        None, overrides(tiny_pair, tmp_path / "run", **{"target.cache": str(sharded_cache)})
    )
    assert Trainer.from_recipe(recipe).cache is not None
