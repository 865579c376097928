"""loss.name=tau (the accepted length of the draft's own chains) and loss.temperature
mixtures, end to end on the tiny pair (train/objective.py, train/temperatures.py)."""

import json
from types import SimpleNamespace

import pytest
import torch

from specdistill.train.config import RecipeError, load_recipe
from specdistill.train.temperatures import FixedShares, Share, TrafficShares
from specdistill.train.trainer import Trainer
from tests.train.helpers import metrics, overrides


def test_tau_distillation_raises_alpha(tiny_pair, tmp_path):
    out = tmp_path / "run"
    extra = {"train.max_steps": 20, "loss.name": "tau", "loss.gamma": 3, "loss.prefixes": 6}
    result = Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, out, **extra))).run()
    assert result["alpha"] > result["alpha_before"] + 0.002
    assert result["tau_pred"][3] > result["tau_pred_before"][3]
    records = [m for m in metrics(out) if "loss" in m]
    assert len(records) == 20
    assert all(0.0 <= m["loss"] <= 1.0 and 0.0 < m["alpha"] <= 1.0 for m in records)


def test_tau_mixed_with_a_per_token_loss_and_chunked(tiny_pair, tmp_path):
    """mix with a tau part, chunked: runs, and its first step's loss is the per-token part
    plus the chain part (the chain part > 0)."""
    out = tmp_path / "run"
    extra = {
        "train.max_steps": 2,
        "loss.name": "mix",
        "loss.parts": "{tau: 0.5, fkl: 0.5}",
        "loss.chunk_size": 16,
        "loss.gamma": 2,
    }
    Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, out, **extra))).run()
    first = [m for m in metrics(out) if "loss" in m][0]
    only_fkl = tmp_path / "fkl"
    extra = {"train.max_steps": 2, "loss.name": "mix", "loss.parts": "{fkl: 0.5}"}
    Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, only_fkl, **extra))).run()
    first_fkl = [m for m in metrics(only_fkl) if "loss" in m][0]
    assert first["loss"] > first_fkl["loss"] + 1e-4
    assert first["alpha"] == pytest.approx(first_fkl["alpha"], rel=1e-5)


def test_gamma_defaults_to_the_largest_evaluated_gamma(tiny_pair, tmp_path):
    from specdistill.train.recipe_loss import resolved_loss

    recipe = load_recipe(
        None,
        overrides(tiny_pair, tmp_path, **{"loss.name": "tau", "eval.speculative.gammas": "[2, 5]"}),
    )
    assert resolved_loss(recipe).chain.gamma == 5


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"loss.name": "tau", "draft.type": "parallel"}, "standalone drafts and EAGLE-3"),
        ({"loss.name": "tau", "loss.prefixes": 0}, "prefixes must be >= 1"),
        ({"loss.name": "tau", "loss.estimator": "reinforce"}, "estimator"),
        ({"loss.name": "fkl", "loss.gamma": 3}, "takes no parameter 'loss.gamma'"),
        ({"loss.temperature": "{0.5: 0.5, 1.0: 0.4}"}, "sum to 1"),
    ],
)
def test_bad_tau_and_temperature_recipes_are_named(tiny_pair, tmp_path, extra, words):
    with pytest.raises(RecipeError, match=words):
        load_recipe(None, overrides(tiny_pair, tmp_path, **extra))


def test_traffic_temperature_needs_the_online_job(tiny_pair, tmp_path):
    recipe = load_recipe(
        None, overrides(tiny_pair, tmp_path / "r", **{"loss.temperature": "traffic"})
    )
    with pytest.raises(RecipeError, match="traffic"):
        Trainer.from_recipe(recipe).run()


def test_a_single_temperature_is_one_share_of_every_row():
    (share,) = FixedShares(0.7).shares({})
    assert share == Share(0.7, 1.0)


def test_traffic_shares_group_rows_by_their_served_sampling():
    served = [(0.0, None), (0.7, 0.9), (0.7, 0.9), (1.0, 1.0)]  # (temperature, top_p)
    items = [SimpleNamespace(temperature=t, top_p=p) for t, p in served]
    shares = TrafficShares(items).shares({"sequence": torch.tensor([1, 0, 2, 3])})
    by_key = {(s.temperature, s.top_p): s.rows.tolist() for s in shares}
    assert by_key == {
        (0.7, 0.9): [True, False, True, False],
        (0.0, None): [False, True, False, False],
        (1.0, 1.0): [False, False, False, True],
    }
    greedy = next(s for s in shares if s.temperature == 0.0)
    assert greedy.loss_temperature == 1.0  # trained at 1, reported as greedy agreement
    off = next(s for s in shares if s.temperature == 1.0)
    assert off.params({"top_p": 0.5}) == {"top_p": None}  # a served top-p of 1 is off


def test_a_temperature_mixture_is_the_weighted_sum_of_its_losses(tiny_pair, tmp_path):
    """One step at {0.5: 0.25, 1.0: 0.75}: its loss is 0.25·loss(0.5) + 0.75·loss(1.0) of the
    same batch and weights (each one step from the same start)."""
    first = {}
    for name, temperature in (("mix", "{0.5: 0.25, 1.0: 0.75}"), ("a", 0.5), ("b", 1.0)):
        out = tmp_path / name
        extra = {"train.max_steps": 1, "loss.temperature": temperature, "loss.name": "tv"}
        Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, out, **extra))).run()
        first[name] = [m for m in metrics(out) if "loss" in m][0]
    expected = 0.25 * first["a"]["loss"] + 0.75 * first["b"]["loss"]
    assert first["mix"]["loss"] == pytest.approx(expected, rel=1e-5)
    report = json.loads((tmp_path / "mix" / "eval.json").read_text())
    mix = report["mixture"]
    assert set(mix["temperatures"]) == {"0.5", "1"}
    assert set(mix["tau_pred"]) == set(report["tau_pred"])
    per = mix["alpha_by_temperature"]
    assert mix["alpha"] == pytest.approx(0.25 * per["0.5"] + 0.75 * per["1"])


def test_tau_trains_an_eagle3_head(tiny_pair, sharp_target, tmp_path):
    """loss.name=tau on an EAGLE-3 head: its own chains (reduced vocabulary, d2t) raise α."""
    from tests.train.helpers import eagle_overrides

    out = tmp_path / "run"
    extra = {"train.max_steps": 20, "loss.name": "tau", "loss.gamma": 3, "loss.prefixes": 8}
    recipe = load_recipe(None, eagle_overrides(tiny_pair, sharp_target, out, **extra))
    result = Trainer.from_recipe(recipe).run()
    assert result["alpha"] > result["alpha_before"] + 0.02
    records = [m for m in metrics(out) if "loss" in m]
    assert len(records) == 20 and all(0.0 <= m["loss"] <= 1.0 for m in records)
