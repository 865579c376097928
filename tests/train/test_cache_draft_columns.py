"""The target cache over a draft's own columns (`specdistill cache --columns draft`,
train/target_cache_vocab.py): a draft over a reduced vocabulary trains from it with the live
target's losses, α, head labels and gradients, without one target forward; a cache built for
another draft vocabulary and the recipes distill would refuse are refused before anything
loads or trains."""

import pytest

from specdistill import cli
from specdistill.train.config import load_recipe
from specdistill.train.target_cache import CacheError
from specdistill.train.target_cache_build import build_cache
from specdistill.train.target_cache_vocab import cache_columns
from specdistill.train.trainer import Trainer
from tests.train.helpers import assert_trains_as_live, overrides

REDUCED = {"draft.model": "target-layers:1", "draft.vocab_size": 100}


def _recipe(tiny_pair, out, **extra):
    return load_recipe(None, overrides(tiny_pair, out, **{**REDUCED, **extra}))


@pytest.mark.parametrize(
    "loss, kind",
    [("fkl", "standalone"), ("lk_lambda", "standalone"), ("lk_lambda", "parallel")],
)
def test_draft_columns_train_as_the_live_target_without_its_forward(
    tiny_pair, tmp_path, loss, kind, monkeypatch
):
    cache = tmp_path / "cache"
    extra = {"loss.name": loss, "acceptance_head.enabled": "true", "draft.type": kind}
    manifest = build_cache(
        _recipe(tiny_pair, tmp_path / "x", **extra),
        cache,
        columns="draft",
        values_dtype="float32",
        print=lambda *a: None,
    )
    assert manifest["columns"] == "draft" and len(manifest["draft_ids"]) == 100
    assert manifest["bytes_per_position"] == 100 * 4 + 4 and cache_columns(cache) == "draft"
    live = Trainer.from_recipe(_recipe(tiny_pair, tmp_path / "live", **extra))
    cached = Trainer.from_recipe(
        _recipe(tiny_pair, tmp_path / "cached", **extra, **{"target.cache": str(cache)})
    )
    assert cached.core.kind.name == kind
    assert_trains_as_live(live, cached, monkeypatch, rel=1e-6, grad_rtol=1e-5)


@pytest.mark.parametrize("loss", ["fkl", "lk_lambda"])
def test_a_reduced_draft_trains_from_a_top_n_cache_of_every_token_as_live(
    tiny_pair, tmp_path, loss, monkeypatch
):
    """A top-N cache holds target ids; a draft over V_d compares them in its own columns
    (losses/rest_bin.py). With every token stored (N = V, float32) that is the live target's
    loss, α, head loss and gradients: the tokens outside V_d are left out as live (to 1e-3:
    the probabilities are stored and renormalised, where the live loss takes a log-softmax;
    the fkl value is a small difference of two sums)."""
    extra = {"loss.name": loss, "acceptance_head.enabled": "true"}
    live = Trainer.from_recipe(_recipe(tiny_pair, tmp_path / "live", **extra))
    cache = tmp_path / "cache"
    manifest = build_cache(
        _recipe(tiny_pair, tmp_path / "x", **extra),
        cache,
        top_n=live.vocab_size,
        values_dtype="float32",
        print=lambda *a: None,
    )
    assert manifest["columns"] == "top-n" and manifest["top_n"] == live.vocab_size > 100
    cached = Trainer.from_recipe(
        _recipe(tiny_pair, tmp_path / "cached", **extra, **{"target.cache": str(cache)})
    )
    assert_trains_as_live(live, cached, monkeypatch, rel=1e-3, grad_rtol=1e-3)


def test_a_cache_of_another_draft_vocabulary_is_refused(tiny_pair, tmp_path):
    cache = tmp_path / "cache"
    build_cache(_recipe(tiny_pair, tmp_path / "x"), cache, columns="draft", print=lambda *a: None)
    other = _recipe(
        tiny_pair, tmp_path / "run", **{"draft.vocab_size": 90, "target.cache": str(cache)}
    )
    with pytest.raises(Exception, match="built over 100 draft columns, this draft has 90"):
        Trainer.from_recipe(other)


@pytest.mark.parametrize(
    "extra, columns, match",
    [
        ({"draft.type": "parallel"}, "top-n", "shifted positions"),  # a top-N cache
        ({"draft.vocab_size": "null"}, "draft", "without draft.vocab_size"),
        ({"loss.temperature": 0.7}, "draft", "temperature 1"),
        ({"acceptance_head.enabled": "true", "eval.temperature": 0}, "draft", "eval.temperature"),
        ({"loss.name": "tau"}, "draft", "loss tau"),
    ],
)
def test_cache_refuses_up_front_what_distill_would_refuse(
    tiny_pair, tmp_path, monkeypatch, extra, columns, match
):
    """Refused before the target loads: nothing is built, nothing is written."""
    from specdistill.models import hub

    monkeypatch.setattr(hub, "load_target", lambda *a, **k: 1 / 0)
    out = tmp_path / "cache"
    with pytest.raises(CacheError, match=match):
        build_cache(_recipe(tiny_pair, tmp_path / "x", **extra), out, columns=columns)
    assert not out.exists()


def test_the_cli_builds_and_distill_trains_from_draft_columns(tiny_pair, tmp_path, capsys):
    args = overrides(tiny_pair, tmp_path / "run", **REDUCED, **{"train.max_steps": 2})
    out = tmp_path / "cache"
    assert cli.main(["cache", "--out", str(out), "--columns", "draft", *args]) == 0
    assert "draft columns: 100" in capsys.readouterr().out
    assert cli.main(["distill", *args, f"target.cache={out}"]) == 0
