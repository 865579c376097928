"""A diverged candidate is never promoted: the gate scores a NaN draft α = 0, a NaN score is
a rejection, a refresh whose step diverges stops the job before anything is published, and a
non-finite training loss that reaches the gate is a rejection under every policy."""

import copy
import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from tests.train.online.helpers import kept, online_recipe, write_shard


def quiet(*args, **kwargs):
    pass


def only_the_initial_draft(root) -> bool:
    """Whether the only published version is the one the job starts from, and it is served."""
    published = sorted(p.name for p in root.iterdir() if p.name.startswith("v"))
    manifest = json.loads((root / "v000001" / "manifest.json").read_text())
    current = (root / "current").read_text().strip()
    return published == ["v000001"] == [current] and manifest["reason"] == "initial draft"


@pytest.fixture(scope="module")
def scored(tiny_pair, traffic_pool):
    """(held-out items, kind, target, tokenizer, incumbent draft) of the tiny pair."""
    from specdistill.drafts import Standalone
    from specdistill.drafts.loader import load_draft
    from specdistill.models.hub import load_model, load_tokenizer

    _, pool = traffic_pool
    tok = load_tokenizer(str(tiny_pair[0]))
    held = [kept(r) for r in pool[:24]]
    assert {h.temperature for h in held} == {0.0, 1.0}  # greedy and sampled traffic
    target, draft = load_model(str(tiny_pair[0])), load_draft(str(tiny_pair[1]))
    return held, Standalone(len(tok)), target, tok, draft


def test_the_gate_scores_a_nan_draft_zero_and_rejects_it(scored, tiny_pair, tmp_path):
    from specdistill.train.online.gate import decide, sequence_alpha

    held, kind, target, tok, incumbent = scored
    diverged = copy.deepcopy(incumbent)
    with torch.no_grad():
        for p in diverged.parameters():
            p.fill_(math.nan)
    a_nan = sequence_alpha(kind, target, diverged, held, tok.pad_token_id)
    assert np.array_equal(a_nan, np.zeros(len(held)))  # at temperature 1 and greedy alike
    a_inc = sequence_alpha(kind, target, incumbent, held, tok.pad_token_id)
    cfg = online_recipe(tiny_pair, tmp_path, min_gain=-1.0).online  # promote any finite score
    verdict = decide(a_nan, a_inc, [h.category for h in held], cfg)
    assert not verdict["promote"] and verdict["alpha_candidate"] == 0.0


@pytest.mark.parametrize("who", ["candidate", "incumbent"])
def test_a_nan_score_is_a_rejection(tiny_pair, tmp_path, who):
    from specdistill.train.online.gate import decide

    cfg = online_recipe(tiny_pair, tmp_path, min_gain=-1.0).online
    good, bad = np.full(12, 0.5), np.full(12, 0.5)
    bad[3] = math.nan
    cand, inc = (bad, good) if who == "candidate" else (good + 0.1, bad)
    verdict = decide(cand, inc, ["code"] * 12, cfg)
    assert not verdict["promote"]
    assert verdict["why"] == f"the {who}'s alpha is not finite on 1 of 12 held-out sequences"


@pytest.mark.parametrize("policy", ["specdistill", "osd"])
def test_a_diverged_refresh_stops_the_job_and_publishes_nothing(
    tiny_pair, traffic_pool, tmp_path, policy
):
    from specdistill.train.online.job import OnlineJob
    from specdistill.train.step import TrainingDiverged

    _, pool = traffic_pool
    write_shard(tmp_path / "traffic", 1, pool[:40])
    recipe = online_recipe(tiny_pair, tmp_path, min_gain=-1.0, policy=policy)
    recipe.train.lr = 1e30
    with pytest.raises(TrainingDiverged, match=r"training diverged at step \d+: loss nan"):
        OnlineJob(recipe, print=quiet).run()
    root = tmp_path / "drafts"
    assert only_the_initial_draft(root)
    assert not (tmp_path / "out" / "decisions.jsonl").exists()


def test_a_non_finite_loss_is_never_promoted_even_by_osd(
    tiny_pair, traffic_pool, tmp_path, monkeypatch
):
    from specdistill.train.online.job import OnlineJob
    from specdistill.train.step import DistillStep

    step = DistillStep.train_step

    def nan_loss(self, batches):  # a step core that reports a NaN loss without stopping
        return dataclasses.replace(step(self, batches), loss=math.nan)

    monkeypatch.setattr(DistillStep, "train_step", nan_loss)
    _, pool = traffic_pool
    write_shard(tmp_path / "traffic", 1, pool[:40])
    recipe = online_recipe(tiny_pair, tmp_path, policy="osd")
    summary = OnlineJob(recipe, print=quiet).run()
    assert summary["refreshes"] >= 1 and summary["promotions"] == 0
    decisions = [json.loads(x) for x in (tmp_path / "out" / "decisions.jsonl").open()]
    assert all(d["decision"] == "rejected" for d in decisions)
    assert decisions[0]["why"].startswith("the training loss is not finite (nan at step 1 of ")
    assert only_the_initial_draft(tmp_path / "drafts")
