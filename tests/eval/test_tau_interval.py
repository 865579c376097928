"""The interval of measured τ over prompts (eval/stats.py `tau_interval`)."""

import math

import pytest

from specdistill.eval import stats
from specdistill.eval.round_stats import Round


def round_of(gamma: int, requests: list[int], accepted: list[int], capped: bool = False) -> Round:
    n = len(requests)
    return Round(
        gamma=gamma,
        capped=capped,
        requests=requests,
        starts=[0] * n,
        accepted=accepted,
        committed=[a + 1 for a in accepted],
        draft_s=0.0,
        verify_s=0.0,
        round_s=0.0,
    )


def rounds_of(per_prompt: dict[int, list[int]], gamma: int = 3) -> list[Round]:
    """One single-row round per accepted count, prompt by prompt."""
    return [round_of(gamma, [p], [n]) for p, ns in per_prompt.items() for n in ns]


def test_interval_holds_the_pooled_tau_and_narrows_with_more_prompts():
    few = {p: [p % 4, (p + 1) % 4] for p in range(4)}
    many = {p: [p % 4, (p + 1) % 4] for p in range(64)}
    tau = stats.acceptance_stats(rounds_of(many))["tau"]
    lo_few, hi_few = stats.tau_interval(rounds_of(few))
    lo, hi = stats.tau_interval(rounds_of(many))
    assert 1.0 <= lo < tau < hi <= 4.0
    assert hi - lo < hi_few - lo_few


def test_a_prompts_rounds_are_resampled_together():
    # Two prompts that always accept everything or nothing: rounds pooled as independent
    # units would give a narrow interval; as two prompts, the interval spans both.
    rounds = rounds_of({0: [3] * 50, 1: [0] * 50})
    lo, hi = stats.tau_interval(rounds, samples=4000)
    assert lo == pytest.approx(1.0) and hi == pytest.approx(4.0)


def test_identical_prompts_give_a_point():
    lo, hi = stats.tau_interval(rounds_of({p: [2, 2] for p in range(8)}))
    assert lo == pytest.approx(3.0) and hi == pytest.approx(3.0)


def test_rows_of_one_round_count_for_their_own_prompts():
    rounds = [round_of(2, [0, 1], [2, 0]) for _ in range(10)]
    lo, hi = stats.tau_interval(rounds, samples=4000)
    assert lo == pytest.approx(1.0) and hi == pytest.approx(3.0)


def test_capped_rounds_and_one_prompt_give_no_interval():
    capped = [round_of(3, [p], [3], capped=True) for p in range(5)]
    assert all(math.isnan(x) for x in stats.tau_interval(capped))
    assert all(math.isnan(x) for x in stats.tau_interval(rounds_of({0: [1, 2, 3]})))
