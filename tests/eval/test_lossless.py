"""Greedy losslessness under rounding (eval/lossless.py): the near-tie bound, and the sweep's
check of a forced divergence from the target alone, classified and reported."""

import pytest
import torch

from specdistill.eval import sweep
from specdistill.eval.lossless import (
    ULPS,
    GreedyChecker,
    classify,
    first_divergence,
    reference_dtype,
)
from specdistill.eval.report import SpeculateReport
from specdistill.eval.report_console import lossless_line
from tests.eval.helpers import perturbed, tiny_llama

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def logits(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# ----------------------------------------------------------------------------- classify


def test_an_exact_tie_is_a_near_tie_in_every_dtype():
    for dtype in (F32, BF16, F16):
        v = classify(logits(1.0, 5.0, 5.0, 2.0), 1, 2, dtype)
        assert v.near_tie and v.gap == 0.0


def test_a_gap_within_rounding_is_a_near_tie_and_a_clear_gap_a_real_error():
    eps = torch.finfo(F32).eps
    within = classify(logits(10.0, 10.0 - 2 * eps * 10.0, -3.0), 0, 1, F32)
    assert within.near_tie and within.gap <= within.tolerance
    assert within.tolerance == pytest.approx(ULPS * eps * 10.0)
    clear = classify(logits(10.0, 9.0, -3.0), 0, 1, F32)
    assert not clear.near_tie and clear.gap == pytest.approx(1.0)
    # Order does not matter: the speculative run may hold the larger logit.
    assert classify(logits(10.0, 9.0, -3.0), 1, 0, F32) == clear


def test_the_bound_scales_with_the_dtype():
    """A 0.1 gap at |logit| 10: within bfloat16's rounding (eps 2^-7), not float16's (2^-10)
    nor float32's (2^-23)."""
    verdicts = {d: classify(logits(10.0, 9.9, 0.0), 0, 1, d) for d in (F32, F16, BF16)}
    assert verdicts[BF16].near_tie
    assert not verdicts[F16].near_tie and not verdicts[F32].near_tie
    assert verdicts[F32].tolerance < verdicts[F16].tolerance < verdicts[BF16].tolerance
    # And with the logits' magnitude (never below 1 near 0).
    assert classify(logits(100.0, 99.0), 0, 1, BF16).near_tie
    assert classify(logits(0.0, -1e-6), 0, 1, F32).tolerance == pytest.approx(
        ULPS * torch.finfo(F32).eps
    )


def test_two_tokens_tied_below_the_top_are_a_real_error():
    """Neither could be the argmax: a third token is clearly above both."""
    v = classify(logits(5.0, 5.0, 9.0), 0, 1, BF16)
    assert not v.near_tie and v.gap == pytest.approx(4.0)


def test_first_divergence_and_reference_dtype():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2
    assert reference_dtype(F32) == torch.float64
    assert reference_dtype(BF16) == reference_dtype(F16) == torch.float32


def test_an_output_that_stops_short_is_a_real_error_without_a_gap():
    target = tiny_llama(0, vocab=32, hidden=32, layers=1, init=0.2)
    check = GreedyChecker(target, 32).check([[1, 2], [3]], [[4, 5], [6, 7]], [[4, 5], [6]])
    assert (check.identical, check.near_ties, check.real_errors) == (1, 0, 1)
    d = check.divergences[0]
    assert (d.prompt, d.position, d.target_token, d.speculative_token) == (1, 1, 7, None)
    assert d.gap is None and d.kind == "real_error"
    assert check.exact_match_rate == 0.5 and check.reference_dtype == "float64"


# ----------------------------------------------------------------------------- the sweep

PROMPTS = [[5, 17, 3], [40, 2, 9, 77, 12, 1], [60]]
SETTINGS = sweep.Settings(gammas=[2], temperatures=(0.0,), max_new_tokens=6)


def swapping(monkeypatch, replace):
    """Make every speculative run's first token of prompt 0 `replace(token)`, as a broken
    verification would (the target alone's run is left as it is)."""
    real = sweep.generate

    def generate(target, draft, prompts, **kwargs):
        g = real(target, draft, prompts, **kwargs)
        if draft is not None:
            g.sequences[0][0] = replace(g.sequences[0][0])
        return g

    monkeypatch.setattr(sweep, "generate", generate)


def checked(target, draft) -> tuple[dict, str]:
    """The sweep's T=0 configuration, typed as report.json holds it, and the console's line."""
    result, _ = sweep.sweep(target, draft, PROMPTS, SETTINGS)
    entry = SpeculateReport.of(result).configs[0]
    assert entry.greedy_check is not None
    return result["configs"][0], lossless_line(result["configs"], len(PROMPTS))


@torch.no_grad()
def next_logits(target, prompt) -> torch.Tensor:
    return target(input_ids=torch.tensor([prompt])).logits[0, -1]


def test_a_wrong_token_where_the_target_is_sure_is_a_real_error(monkeypatch):
    target = tiny_llama(0, vocab=96, hidden=64, layers=2, init=0.2)
    draft = perturbed(target, 0.015, seed=1)
    worst = int(next_logits(target, PROMPTS[0]).argmin())
    swapping(monkeypatch, lambda token: worst)
    entry, line = checked(target, draft)
    check = entry["greedy_check"]
    assert entry["greedy_identical"] == check["identical"] == 2
    assert (check["real_errors"], check["near_ties"]) == (1, 0)
    d = check["divergences"][0]
    assert (d["prompt"], d["position"], d["speculative_token"]) == (0, 0, worst)
    assert d["kind"] == "real_error" and d["gap"] > 100 * d["tolerance"]
    assert line.startswith(
        "LOSSLESS CHECK FAILED at T=0, real errors in: T=0 gamma=2 (2/3 identical, 1 real error)"
    )


def test_the_runner_up_of_an_exact_tie_is_a_near_tie(monkeypatch):
    """The target's output head gets two equal rows, a and b, where a is the argmax of
    prompt 0's first token: the target alone emits one, the forced run the other."""
    target = tiny_llama(0, vocab=96, hidden=64, layers=2, init=0.2)
    a = int(next_logits(target, PROMPTS[0]).argmax())
    b = (a + 7) % 96
    with torch.no_grad():
        target.lm_head.weight[b] = target.lm_head.weight[a]
    draft = perturbed(target, 0.015, seed=1)
    swapping(monkeypatch, lambda token: {a, b}.difference({token}).pop())
    entry, line = checked(target, draft)
    check = entry["greedy_check"]
    assert (check["identical"], check["near_ties"], check["real_errors"]) == (2, 1, 0)
    d = check["divergences"][0]
    assert {d["target_token"], d["speculative_token"]} == {a, b}
    assert d["kind"] == "near_tie" and d["gap"] == 0.0
    assert "FAILED" not in line
    assert line.startswith("Lossless at T=0 up to rounding:")
    assert "T=0 gamma=2 (2/3 identical, 1 near-tie)" in line
