"""An EAGLE-3 head trained from stored outputs (train/target_cache.py): the cache over the
head's own columns also holds the hidden states entering its aux layers, captured in the
same target forward, so that a step runs no target forward and gives the live target's
losses, α, head labels and gradients; a cache without them, or over other layers, is
refused before training."""

import pytest
import torch

from specdistill.train.config import RecipeError, load_recipe
from specdistill.train.target_cache import TargetCache
from specdistill.train.target_cache_build import build_cache
from specdistill.train.trainer import Trainer
from tests.train.helpers import assert_trains_as_live, eagle_overrides, overrides

QUIET = {"print": lambda *a: None}


def _recipe(tiny_pair, target, out, **extra):
    return load_recipe(None, eagle_overrides(tiny_pair, target, out, **extra))


@pytest.mark.parametrize("loss", ["fkl", "lk_lambda"])
def test_a_head_trains_from_stored_outputs_as_from_the_live_target(
    tiny_pair, sharp_target, tmp_path, loss, monkeypatch
):
    cache = tmp_path / "cache"
    extra = {"loss.name": loss, "acceptance_head.enabled": "true"}
    manifest = build_cache(
        _recipe(tiny_pair, sharp_target, tmp_path / "x", **extra),
        cache,
        columns="draft",
        values_dtype="float32",
        **QUIET,
    )
    assert manifest["columns"] == "draft" and len(manifest["draft_ids"]) == 200
    assert manifest["features"]["layers"] == [0, 1]
    width = manifest["features"]["width"]
    stored = TargetCache(cache)
    # every attended position of every sequence: more positions than loss rows
    rows = sum(s["feature_rows"] for s in manifest["splits"]["train"]["shards"])
    assert rows >= manifest["splits"]["train"]["positions"] and stored.features["width"] == width
    live = Trainer.from_recipe(_recipe(tiny_pair, sharp_target, tmp_path / "live", **extra))
    cached = Trainer.from_recipe(
        _recipe(
            tiny_pair, sharp_target, tmp_path / "cached", **extra, **{"target.cache": str(cache)}
        )
    )
    assert_trains_as_live(live, cached, monkeypatch, rel=1e-5, grad_rtol=1e-4)


def test_float16_features_train_close_to_the_live_target(tiny_pair, sharp_target, tmp_path):
    cache = tmp_path / "cache"
    build_cache(_recipe(tiny_pair, sharp_target, tmp_path / "x"), cache, columns="draft", **QUIET)
    live = Trainer.from_recipe(_recipe(tiny_pair, sharp_target, tmp_path / "live"))
    cached = Trainer.from_recipe(
        _recipe(tiny_pair, sharp_target, tmp_path / "cached", **{"target.cache": str(cache)})
    )
    cached.draft.load_state_dict(live.draft.state_dict())
    for a, b in zip(live.micro_batches(0), cached.micro_batches(0), strict=True):
        with torch.no_grad():
            want, got = live.core.losses(a), cached.core.losses(b)
        assert float(got.loss_sum) == pytest.approx(float(want.loss_sum), rel=2e-3)
        assert float(got.alpha_sum) == pytest.approx(float(want.alpha_sum), rel=2e-3)


def test_a_cache_without_the_heads_features_is_refused(tiny_pair, sharp_target, tmp_path):
    # The standalone draft's cache over the same 200 columns holds no hidden states.
    cache = tmp_path / "cache"
    standalone = {
        "target.model": str(sharp_target),
        "draft.model": "target-layers:1",
        "draft.vocab_size": 200,
    }
    recipe = load_recipe(None, overrides(tiny_pair, tmp_path / "x", **standalone))
    build_cache(recipe, cache, columns="draft", **QUIET)
    with pytest.raises(RecipeError, match=r"holds no hidden states.*layers \[0, 1\]"):
        Trainer.from_recipe(
            _recipe(tiny_pair, sharp_target, tmp_path / "run", **{"target.cache": str(cache)})
        )


def test_a_cache_over_other_layers_is_refused(tiny_pair, sharp_target, tmp_path):
    cache = tmp_path / "cache"
    build_cache(
        _recipe(tiny_pair, sharp_target, tmp_path / "x", **{"draft.aux_layers": "[1, 1]"}),
        cache,
        columns="draft",
        **QUIET,
    )
    with pytest.raises(RecipeError, match=r"inputs of layers \[1, 1\].*\[0, 1\]"):
        Trainer.from_recipe(
            _recipe(tiny_pair, sharp_target, tmp_path / "run", **{"target.cache": str(cache)})
        )


def test_a_damaged_feature_tensor_is_found_before_training(tiny_pair, sharp_target, tmp_path):
    from safetensors.torch import load_file, save_file

    cache = tmp_path / "cache"
    manifest = build_cache(
        _recipe(tiny_pair, sharp_target, tmp_path / "x"), cache, columns="draft", **QUIET
    )
    shard = cache / manifest["splits"]["train"]["shards"][0]["file"]
    tensors = load_file(shard)
    tensors["features"] = tensors["features"][:-1].contiguous()  # one position lost
    save_file(tensors, shard)
    with pytest.raises(RecipeError, match="holds tensors|bytes"):
        Trainer.from_recipe(
            _recipe(tiny_pair, sharp_target, tmp_path / "run", **{"target.cache": str(cache)})
        )


def test_a_top_n_cache_is_refused_with_the_way_to_build_the_heads(
    tiny_pair, sharp_target, tmp_path
):
    from specdistill.train.target_cache import CacheError

    with pytest.raises(CacheError, match="columns draft"):
        build_cache(
            _recipe(tiny_pair, sharp_target, tmp_path / "x"),
            tmp_path / "cache",
            columns="top-n",
            **QUIET,
        )
