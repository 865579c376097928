"""`specdistill serve --gamma auto`: draft lengths by load, their statistics and /metrics."""

import math
import shutil
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdistill.errors import UserError
from specdistill.eval import length_policy
from specdistill.eval.cli_args import DEFAULT_GAMMA
from specdistill.eval.cost_model import CostModel
from specdistill.eval.length_policy import AutoGamma, FixedGamma, GammaSetting
from specdistill.serve.options import ServeOptions
from specdistill.serve.server import Server
from tests.helpers import hf_greedy

PROMPTS = ["def add(a, b):", "class Point:\n    def", "for i in range(10):", "import os\n"]
MAX_GAMMA = 4


class CheapDrafts(AutoGamma):
    """`AutoGamma` with costs fixed so that drafting always pays (draft steps free, a flat
    verification): the tiny pair's measured costs make the rule draft little or nothing."""

    def measure(self, target, vocab_size: int, batch_size: int) -> None:
        self.cost = CostModel(self.max_gamma, lambda b: [1.0] * (self.max_gamma + 1), weight=1e-9)
        self.cost.measured(batch_size).draft_s = 1e-9


@pytest.fixture(scope="module", params=["measured", "always-drafting"])
def auto_server(request, tiny_pair):
    """A --gamma auto server on the tiny pair: with the costs it measures, and with costs
    under which every row drafts (so the ragged verification runs behind the HTTP side)."""
    target, draft, _ = tiny_pair
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "always-drafting":
            mp.setattr(length_policy, "AutoGamma", CheapDrafts)
        srv = Server(
            ServeOptions(
                target=str(target),
                draft=str(draft),
                gamma="auto",
                max_gamma=MAX_GAMMA,
                max_num_seqs=4,
                served_model_name="tiny",
            )
        )
    url = srv.start()
    yield url, srv, request.param
    srv.stop()


def test_auto_greedy_equals_target_and_reports_lengths(auto_server, tiny_pair):
    """Concurrent greedy requests under --gamma auto give the target's own greedy output,
    and each response's statistics carry the drafted-length histogram beside vLLM's keys."""
    url, srv, costs = auto_server
    policy = srv.worker.current.batch.policy
    assert isinstance(policy, AutoGamma)
    assert isinstance(policy, CheapDrafts) == (costs == "always-drafting")
    if costs == "measured":  # every batch size up to the 4 rows has costs of its own
        assert set(policy.cost.tables) >= {1, 2, 4}
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    tok = srv.tokenizer
    results = {}

    def one(i: int, prompt: str) -> None:
        results[i] = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=20, temperature=0
        )

    threads = [threading.Thread(target=one, args=job) for job in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rounds_total = 0
    target = AutoModelForCausalLM.from_pretrained(tiny_pair[0]).eval()
    target_tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    for i, prompt in enumerate(PROMPTS):
        r = results[i]
        ids = tok(prompt)["input_ids"]
        expected = hf_greedy(target, target_tok, ids, 20)
        assert r.choices[0].text == tok.decode(expected, skip_special_tokens=True)
        spec = r.metrics["speculative_decoding"]
        hist = spec["drafted_length_histogram"]
        assert 1 <= len(hist) <= MAX_GAMMA + 1
        assert sum(k * n for k, n in enumerate(hist)) == spec["num_draft_tokens"]
        assert sum(hist[1:]) == spec["num_spec_steps"]
        assert {"mean_drafted_length", "mean_predicted_acceptance", "mean_realised_acceptance"} <= (
            set(spec)
        )
        assert {"num_spec_steps", "acceptance_histogram", "mean_acceptance_length"} <= set(spec)
        rounds_total += sum(hist)
        if costs == "always-drafting":
            assert spec["num_draft_tokens"] > 0
            assert 0.0 <= spec["mean_predicted_acceptance"] <= 1.0
    metrics_show_the_lengths(url, list(results.values()), rounds_total, costs)


def metrics_show_the_lengths(url: str, responses, rounds_total: int, costs: str) -> None:
    text = httpx.get(url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    hist = families["specdistill:spec_decode_drafted_length"]
    assert hist.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in hist.samples if s.name.endswith("_bucket")}
    assert set(buckets) == {f"{k}.0" for k in range(MAX_GAMMA + 1)} | {"+Inf"}
    (count,) = [s.value for s in hist.samples if s.name.endswith("_count")]
    assert count == rounds_total  # the four responses are the only ones this server saw
    target_only = sum(
        r.metrics["speculative_decoding"]["drafted_length_histogram"][0] for r in responses
    )
    (only,) = [
        s.value
        for s in families["specdistill:spec_decode_num_target_only_rounds"].samples
        if s.name.endswith("_total")
    ]
    assert only == target_only == buckets["0.0"]
    reached = any(r.metrics["speculative_decoding"]["num_draft_tokens"] for r in responses)
    assert reached or costs == "measured"
    for name in ("predicted", "realised"):
        (g,) = families[f"specdistill:spec_decode_mean_{name}_acceptance"].samples
        if reached:
            assert 0.0 <= g.value <= 1.0
        else:
            assert math.isnan(g.value)  # no draft reached verification


def test_metrics_acceptance_gauges_weigh_every_reached_draft():
    """The gauges are the pooled means over every reached draft, not a mean of means."""
    from specdistill.serve.metrics import Metrics
    from specdistill.serve.worker import LengthTally

    m = Metrics(max_gamma=3)
    stats = {
        "num_spec_steps": 1,
        "num_draft_tokens": 2,
        "num_accepted_draft_tokens": 1,
        "acceptance_histogram": [1, 0],
        "drafted_length_histogram": [2, 0, 1],
    }
    m.finished(stats, 3, 4, "length", 0.1, 0.05, LengthTally(1.5, 2, 1))
    m.finished(stats, 3, 4, "length", 0.1, 0.05, LengthTally(5.0, 6, 6))
    families = {f.name: f for f in text_string_to_metric_families(m.expose(None).decode())}
    (p,) = families["specdistill:spec_decode_mean_predicted_acceptance"].samples
    (a,) = families["specdistill:spec_decode_mean_realised_acceptance"].samples
    assert p.value == pytest.approx(6.5 / 8) and a.value == pytest.approx(7 / 8)
    hist = families["specdistill:spec_decode_drafted_length"].samples
    (total,) = [s.value for s in hist if s.name.endswith("_sum")]
    assert total == 4.0  # two rounds of 2 drafts


def test_default_gamma_follows_the_acceptance_head(tiny_pair, tmp_path):
    """--gamma unset: auto for a draft with an acceptance head, the fixed default without;
    an explicit value wins either way."""
    from specdistill.drafts.acceptance_head import (
        AcceptanceHead,
        AcceptanceHeadConfig,
        save_acceptance_head,
    )
    from specdistill.drafts.loader import load_draft

    _, draft_dir, _ = tiny_pair
    plain = load_draft(str(draft_dir))
    headed_dir = tmp_path / "headed"
    shutil.copytree(draft_dir, headed_dir)
    save_acceptance_head(AcceptanceHead(AcceptanceHeadConfig.for_draft(plain)), headed_dir)
    headed = load_draft(str(headed_dir))
    assert getattr(headed, "acceptance_head", None) is not None
    default = GammaSetting(None, max_gamma=6)
    auto = default.policy(headed)
    assert isinstance(auto, AutoGamma) and auto.max_gamma == 6
    assert default.policy(headed, capacity=16).batch_sizes == (1, 2, 4, 8)
    assert default.policy(headed, capacity=6).batch_sizes == (1, 2, 4)
    assert default.policy(plain) == FixedGamma(DEFAULT_GAMMA)
    assert GammaSetting(3, 6).policy(headed) == FixedGamma(3)
    assert isinstance(GammaSetting("auto", 6).policy(plain), AutoGamma)
    assert GammaSetting("auto", 6).policy(None) == FixedGamma(0)  # no draft: the target alone
    assert GammaSetting(9, 6).most_drafts == 9 and GammaSetting("auto", 6).most_drafts == 6


@pytest.mark.parametrize("bad", ["0", "-1", "fast", "2.5", 0, 2.5, True])
def test_bad_gamma_is_a_user_error(bad):
    with pytest.raises(UserError, match="--gamma must be an integer >= 1 or 'auto'"):
        ServeOptions(target="t", draft="d", gamma=bad)


def test_gamma_flag_values():
    def gamma(value):
        return ServeOptions(target="t", draft="d", gamma=value).gamma

    assert gamma("auto") == "auto" and gamma(None) is None
    assert gamma("3") == 3 and gamma(2) == 2


def test_bad_max_gamma_is_a_user_error():
    with pytest.raises(UserError, match="--max-gamma must be an integer >= 1, got 0"):
        ServeOptions(target="t", draft="d", gamma="auto", max_gamma=0)
