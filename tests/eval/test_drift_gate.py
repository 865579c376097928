"""The drift gate (eval/drift_gate.py, `specdistill drift --fail-if-drop-above`,
`--fail-if-tau-drop-above`): judged at every served temperature or at a traffic mixture, on
the lower bound of the drop of α or of predicted τ; the exit status."""

import json

import numpy as np
import pytest

from specdistill.eval import drift, drift_cli
from specdistill.eval.drift_gate import judge, parse_mix, tau
from specdistill.eval.stats import tau_chain, tau_iid
from tests.eval.helpers import drift_argv
from tests.helpers import make_lora_adapter


def _pairs(alpha_before, alpha_after, n=40, count=20, seed=0):
    """[N, 2] (Σ α, n) per prompt around the given α, before and after."""
    rng = np.random.default_rng(seed)
    b = np.clip(alpha_before + rng.normal(0, 0.01, n), 0, 1)
    a = np.clip(alpha_after + rng.normal(0, 0.01, n), 0, 1)
    counts = np.full(n, float(count))
    return np.stack([b * counts, counts], 1), np.stack([a * counts, counts], 1)


def test_greedy_loss_fails_the_gate_even_when_t1_gains():
    """The issue's case: α at T = 1 rises while greedy α falls; a gate on T = 1 alone (the old
    default verdict) passes, the gate on every served temperature fails."""
    pairs = {0.0: _pairs(0.26, 0.22, seed=1), 1.0: _pairs(0.527, 0.545, seed=2)}
    each = judge(pairs, threshold=0.02, samples=300)
    assert each.failed and each.judged == "each temperature"
    by_name = {c.name: c for c in each.checks}
    assert by_name["T=0"].failed and not by_name["T=1"].failed
    assert by_name["T=0"].drop_ci[0] > 0.02 and by_name["T=1"].drop < 0
    assert "T=0" in each.reason and "T=1" not in each.reason
    t1_only = judge({1.0: pairs[1.0]}, threshold=0.02, samples=300)
    assert not t1_only.failed
    # A mixture that is mostly T = 1 traffic does not fail; mostly greedy traffic does.
    mostly_sampled = judge(pairs, threshold=0.02, weights={0.0: 0.1, 1.0: 0.9}, samples=300)
    assert not mostly_sampled.failed and mostly_sampled.judged == "mixture"
    mix = mostly_sampled.checks[-1]
    assert mix.name == "mixture"
    assert mix.drop == pytest.approx(0.1 * by_name["T=0"].drop + 0.9 * by_name["T=1"].drop)
    mostly_greedy = judge(pairs, threshold=0.02, weights={0.0: 0.9, 1.0: 0.1}, samples=300)
    assert mostly_greedy.failed and mostly_greedy.reason.startswith("mixture:")


def test_the_gate_judges_the_lower_bound_not_the_point():
    """A drop whose point passes the threshold but whose interval reaches below it passes."""
    rng = np.random.default_rng(3)
    counts = np.full(30, 10.0)
    b = np.full(30, 0.8)
    a = np.clip(0.77 + rng.normal(0, 0.08, 30), 0, 1)  # noisy: a wide interval
    pair = (np.stack([b * counts, counts], 1), np.stack([a * counts, counts], 1))
    gate = judge({1.0: pair}, threshold=0.02, samples=500)
    (check,) = gate.checks
    assert check.drop > 0.02 and check.drop_ci[0] <= 0.02 and not gate.failed
    assert judge({1.0: pair}, threshold=check.drop_ci[0] - 1e-6, samples=500).failed


def test_the_gate_interval_is_the_reports_interval():
    """Per temperature the gate's interval is the report's alpha_drop_ci (same draws)."""
    before, after = _pairs(0.7, 0.65, seed=4)
    cell = drift.paired_bootstrap(before, after, samples=200, seed=7)
    (check,) = judge({1.0: (before, after)}, threshold=None, samples=200, seed=7).checks
    assert check.drop_ci == cell["drop_ci"] and check.drop == pytest.approx(cell["drop"])
    assert check.failed is None


def test_the_tau_gate_fails_a_small_alpha_drop_that_costs_tokens_per_round():
    """At α ≈ 0.9 a drop of 0.02 costs ~5% of τ(5): the α gate at 0.02 passes it (its lower
    bound lies below), the τ gate at 2% fails it; a drop that costs under 2% of τ passes."""
    pair = _pairs(0.90, 0.88, seed=5)
    alpha_only = judge({1.0: pair}, threshold=0.02, samples=400)
    (check,) = alpha_only.checks
    assert not alpha_only.failed and check.drop_ci[0] < 0.02
    assert check.tau_before == pytest.approx(tau_iid(check.alpha_before, 5))
    assert check.tau_drop == pytest.approx(1 - check.tau_after / check.tau_before)
    assert check.tau_drop_ci[0] > 0.03
    both = judge({1.0: pair}, threshold=0.02, tau_threshold=0.02, samples=400)
    assert both.failed and "τ(5) drop's lower bound" in both.reason
    assert "the drop's lower bound" not in both.reason
    small = judge({1.0: _pairs(0.40, 0.39, seed=6)}, threshold=None, tau_threshold=0.02)
    assert not small.failed and small.checks[0].tau_drop_ci[0] < 0.02
    assert (
        judge({1.0: pair}, threshold=None, tau_threshold=0.02, tau_gamma=1).checks[0].tau_drop
        < check.tau_drop
    )  # τ(1) = 1 + α moves less than τ(5)


def test_tau_uses_every_depth_as_the_report_does():
    """[N, D, 2] pairs: α judged at depth 0, τ the chain of the per-depth ratios."""
    rng = np.random.default_rng(7)
    counts = np.full((30, 3), 10.0)
    alphas = np.clip(np.array([0.7, 0.5, 0.4]) + rng.normal(0, 0.02, (30, 3)), 0, 1)
    before = np.stack([alphas * counts, counts], -1)
    after = np.stack([alphas * 0.9 * counts, counts], -1)
    (check,) = judge({0.0: (before, after)}, threshold=None, samples=100).checks
    per_depth = (alphas * counts).sum(0) / counts.sum(0)
    assert check.alpha_before == pytest.approx(per_depth[0])
    assert check.tau_before == pytest.approx(tau_chain(list(per_depth), 5))
    assert check.tau_after == pytest.approx(tau_chain(list(per_depth * 0.9), 5))
    assert tau(np.array([1.0]), 3) == 4.0 and tau(np.array([0.0, 0.5]), 3) == 1.0


def test_no_threshold_never_fails():
    gate = judge({0.0: _pairs(0.9, 0.1)}, threshold=None, samples=50)
    assert not gate.failed and "no threshold" in gate.reason


@pytest.mark.parametrize(
    "text, problem",
    [("0:1,0:2", "twice"), ("0", "T:W"), ("a:1", "T:W"), ("0:-1", "T:W"), ("0:0", "positive")],
)
def test_bad_mixtures_are_named(text, problem):
    with pytest.raises(ValueError, match=problem):
        parse_mix(text)


def test_mixture_is_normalised():
    assert parse_mix("0:1, 1:3") == {0.0: 0.25, 1.0: 0.75}


@pytest.fixture
def gate_prompt_file(tmp_path):
    """A prompts.jsonl of 8 code prompts without categories."""
    path = tmp_path / "prompts.jsonl"
    starts = ["def add(a, b):\n", "class Point:\n", "for i in range(", "import os\n"]
    path.write_text("".join(json.dumps({"prompt": starts[i % 4]}) + "\n" for i in range(8)))
    return path


def test_exit_status_fails_a_deploy_on_a_real_drop(tiny_pair, gate_prompt_file, tmp_path):
    """The draft is the before-target (α_before = 1); a scaled LoRA on the after-target drops
    α at both temperatures: exit 1 past a threshold, 0 under it, reports per temperature."""
    target, _, _ = tiny_pair
    adapter = make_lora_adapter(target, tmp_path / "adapter", scale=2.0)
    base = drift_argv(
        target, target, gate_prompt_file, tmp_path / "gate", "--adapter-after", str(adapter)
    )
    base += ["--temperature", "0,1"]
    run = drift_cli.run([*base, "--fail-if-drop-above", "0.01"])
    assert sorted(run.reports) == [0.0, 1.0]
    assert run.gate.failed and [c.name for c in run.gate.checks] == ["T=0", "T=1"]
    for t, check in zip((0.0, 1.0), run.gate.checks, strict=True):
        assert check.drop_ci == run.reports[t]["alpha_drop_ci"]
        assert (tmp_path / "gate" / f"T{t:g}" / "report.json").is_file()
        report_tau = {int(g): v for g, v in run.reports[t]["tau_before"].items()}
        assert check.tau_before == pytest.approx(report_tau[5])
    saved = json.loads((tmp_path / "gate" / "gate.json").read_text())
    assert saved["failed"] is True and saved["threshold"] == 0.01
    assert drift_cli.main([*base, "--overwrite", "--fail-if-drop-above", "1"]) == 0
    tau_gate = [*base, "--overwrite", "--fail-if-tau-drop-above", "0.01", "--tau-gamma", "3"]
    assert drift_cli.main(tau_gate) == 1
    saved = json.loads((tmp_path / "gate" / "gate.json").read_text())
    assert saved["tau_threshold"] == 0.01 and saved["tau_gamma"] == 3
    assert saved["threshold"] is None and "τ(3) drop's lower bound" in saved["reason"]
    with pytest.raises(SystemExit) as exit_:
        drift_cli.main([*base, "--overwrite", "--fail-if-tau-drop-above", "nan"])
    assert exit_.value.code == 2


def test_main_exits_1_only_when_the_gate_fails(monkeypatch):
    from specdistill.eval.drift_gate import GateReport

    def gate(failed):
        return GateReport(
            threshold=0.0, tau_threshold=None, tau_gamma=5, confidence=0.95,
            judged="each temperature", weights=None, checks=[], failed=failed, reason="",
        )  # fmt: skip

    for failed, status in ((True, 1), (False, 0)):
        monkeypatch.setattr(
            drift_cli, "run", lambda argv, f=failed: drift_cli.DriftRun({}, gate(f))
        )
        assert drift_cli.main([]) == status


def test_self_drift_passes_at_a_mixture(tiny_pair, gate_prompt_file, tmp_path):
    target, draft, _ = tiny_pair
    argv = drift_argv(
        draft, target, gate_prompt_file, tmp_path / "mix", "--temperature-mix", "0:1,1:3"
    )
    run = drift_cli.run([*argv, "--fail-if-drop-above", "0"])
    assert not run.gate.failed and run.gate.weights == {"0": 0.25, "1": 0.75}
    assert run.gate.checks[-1].name == "mixture" and run.gate.checks[-1].drop_ci == [0.0, 0.0]
    assert run.gate.checks[-1].tau_drop == 0.0 and run.gate.checks[-1].tau_drop_ci == [0.0, 0.0]


def test_temperature_and_mixture_are_exclusive(tiny_pair, gate_prompt_file, tmp_path, capsys):
    target, draft, _ = tiny_pair
    argv = drift_argv(draft, target, gate_prompt_file, tmp_path / "x", "--temperature", "0")
    with pytest.raises(SystemExit) as exit_:
        drift_cli.main([*argv, "--temperature-mix", "0:1"])
    assert exit_.value.code == 2 and "not allowed with" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def _traffic(directory, temperatures_and_tokens):
    from specdistill.serve.traffic import TrafficLog
    from tests.serve.helpers import record

    log = TrafficLog(directory)
    for i, (t, n) in enumerate(temperatures_and_tokens):
        sampling = {"temperature": t, "top_p": 1.0, "max_tokens": n or 1, "seed": None, "stop": []}
        log.append(
            record(id=f"r{i}", sampling=sampling, completion_token_ids=list(range(3, 3 + n)),
                   top_logprobs=None)
        )  # fmt: skip
    log.close()
    return directory


def test_the_traffic_logs_mixture_is_its_share_of_completion_tokens(tmp_path):
    from specdistill.formats.traffic import TrafficError

    traffic = _traffic(tmp_path / "t", [(0.0, 2), (1.0, 6), (1.0, 2), (0.0, 0)])
    assert drift_cli.temperature_mix(traffic) == {0.0: 0.2, 1.0: 0.8}
    with pytest.raises(TrafficError, match="no such directory"):
        drift_cli.temperature_mix(tmp_path / "nope")
    empty = _traffic(tmp_path / "e", [(0.7, 0)])
    with pytest.raises(TrafficError, match="no completion tokens"):
        drift_cli.temperature_mix(empty)


def test_the_gate_judges_the_traffic_logs_mixture(tiny_pair, gate_prompt_file, tmp_path):
    target, draft, _ = tiny_pair
    traffic = _traffic(tmp_path / "traffic", [(0.0, 1), (1.0, 3)])
    argv = drift_argv(draft, target, gate_prompt_file, tmp_path / "out", "--traffic", str(traffic))
    run = drift_cli.run([*argv, "--fail-if-drop-above", "0"])
    assert sorted(run.reports) == [0.0, 1.0] and run.gate.judged == "mixture"
    assert run.gate.weights == {"0": 0.25, "1": 0.75} and not run.gate.failed
