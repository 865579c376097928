"""Refreshes that train on the records' own top_logprobs (sparse targets with a rest bin)
instead of a forward of the target (train/online/sparse.py RecordTargets)."""

import json

import pytest
import torch

from tests.train.online.helpers import job, kept, lines, online_recipe, write_shard


def with_top_logprobs(job_, records: list[dict], k: int | None) -> list[dict]:
    """The records with the job's target's raw top-k (None: the whole vocabulary) per
    completion token, [token_id, logprob], as the server logs them."""
    out = []
    for r in records:
        ids = torch.tensor([r["prompt_token_ids"] + r["completion_token_ids"]])
        with torch.no_grad():
            logits = job_.target(input_ids=ids).logits[0, :, : job_.vocab_size]
        logp = torch.log_softmax(logits.double(), -1)
        n = len(r["prompt_token_ids"])
        top = []
        for pos in range(n - 1, ids.shape[1] - 1):
            values, index = logp[pos].topk(k or job_.vocab_size)
            top.append([[int(i), float(v)] for i, v in zip(index, values, strict=True)])
        out.append(dict(r, top_logprobs=top))
    return out


def loss_and_grads(job_, items, sparse: bool):
    core = job_.core
    batch = job_.refresh_batches(items, sparse).micro_batches(0)[0]
    core.draft.zero_grad()
    loss, _ = core.loss(batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in core.draft.named_parameters() if p.grad is not None}
    core.draft.zero_grad()
    return loss.detach(), grads


@pytest.mark.parametrize("loss", ["fkl", "tv"])
def test_full_vocabulary_top_logprobs_equal_the_live_target(
    tiny_pair, traffic_pool, tmp_path, loss
):
    _, pool = traffic_pool
    recipe = online_recipe(tiny_pair, tmp_path)
    recipe.loss.name = loss
    j = job(recipe)
    items = [kept(r, top_logprobs=True) for r in with_top_logprobs(j, pool[:8], None)]
    live, live_grads = loss_and_grads(j, items, sparse=False)
    sparse, sparse_grads = loss_and_grads(j, items, sparse=True)
    torch.testing.assert_close(sparse, live, rtol=1e-4, atol=1e-6)
    assert live_grads.keys() == sparse_grads.keys() and live_grads
    for name, g in live_grads.items():
        torch.testing.assert_close(sparse_grads[name], g, rtol=1e-3, atol=1e-6)


def test_top_k_records_train_without_the_target_forward(tiny_pair, traffic_pool, tmp_path):
    _, pool = traffic_pool
    j = job(online_recipe(tiny_pair, tmp_path, min_gain=-1.0, sparse_targets=True))
    records = with_top_logprobs(j, pool[:40], 3)
    write_shard(tmp_path / "traffic", 1, records)
    calls = {"n": 0}
    forward = j.target.forward

    def counted(*args, **kwargs):
        calls["n"] += 1
        return forward(*args, **kwargs)

    j.target.forward = counted
    gate_calls = {"n": 0}
    from specdistill.train.online import gate as online_gate

    real_alpha = online_gate.sequence_alpha

    def gate_alpha(*args, **kwargs):  # the gate runs the target: counted apart
        before = calls["n"]
        out = real_alpha(*args, **kwargs)
        gate_calls["n"] += calls["n"] - before
        return out

    online_gate.sequence_alpha = gate_alpha
    try:
        summary = j.run()
    finally:
        online_gate.sequence_alpha = real_alpha
    decisions = lines(tmp_path / "out" / "decisions.jsonl")
    assert summary["refreshes"] >= 1 and decisions
    assert all(d["target"] == "records' top_logprobs" for d in decisions)
    assert calls["n"] == gate_calls["n"] > 0  # the target ran for the gate only
    assert all(d["loss"] == d["loss"] for d in decisions)  # finite


def test_a_loss_at_another_temperature_falls_back_to_the_live_target(
    tiny_pair, traffic_pool, tmp_path
):
    _, pool = traffic_pool
    said = []
    from specdistill.train.online.job import OnlineJob

    recipe = online_recipe(tiny_pair, tmp_path, min_gain=-1.0, sparse_targets=True)
    recipe.loss.temperature = 0.5
    j = OnlineJob(recipe, print=lambda *a, **k: said.append(" ".join(map(str, a))))
    write_shard(tmp_path / "traffic", 1, with_top_logprobs(j, pool[:40], 3))
    j.run()
    decisions = lines(tmp_path / "out" / "decisions.jsonl")
    assert decisions and all(d["target"] == "live" for d in decisions)
    assert any("loss.temperature=0.5" in line for line in said)
    assert json.dumps(said).count("sparse targets need") == 1  # said once
