"""loss.temperature=traffic: each record trained at the temperature and top-p it was served
with (train/temperatures.py TrafficShares, set by the online job's refreshes)."""

import dataclasses

import pytest

from tests.train.online.helpers import job, kept, online_recipe


def first_batch_loss(tiny_pair, tmp, loss, temperature, params, items) -> float:
    recipe = online_recipe(tiny_pair, tmp)
    recipe.loss.name, recipe.loss.temperature, recipe.loss.params = loss, temperature, params
    j = job(recipe)
    batch = j.refresh_batches(items, False).micro_batches(0)[0]
    loss, _ = j.core.loss(batch)
    return float(loss.detach())


def served(items, temperature, top_p):
    return [dataclasses.replace(it, temperature=temperature, top_p=top_p) for it in items]


@pytest.mark.parametrize("loss", ["tv", "tau"])
def test_traffic_trains_each_record_at_its_served_sampling(tiny_pair, traffic_pool, tmp_path, loss):
    _, pool = traffic_pool
    items = [kept(r) for r in pool[:8]]
    assert items[0].top_p == 1.0
    own = {"gamma": 2, "prefixes": 2} if loss == "tau" else {}
    at_served = first_batch_loss(
        tiny_pair, tmp_path / "a", loss, "traffic", own, served(items, 0.5, 0.9)
    )
    fixed = first_batch_loss(tiny_pair, tmp_path / "b", loss, 0.5, {**own, "top_p": 0.9}, items)
    assert at_served == pytest.approx(fixed, rel=1e-5)
    # the records' sampling, not the recipe's, decides: served at 1.0 the loss differs
    other = first_batch_loss(
        tiny_pair, tmp_path / "c", loss, "traffic", own, served(items, 1.0, None)
    )
    assert abs(other - at_served) > 1e-6
