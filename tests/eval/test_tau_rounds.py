"""τ with the real round boundaries (`stats.tau_rounds`, issue 15): exact at T=0 against the
engine, within a few standard errors at T=1, and the closed forms it must reduce to."""

import math

import pytest
import torch

from specdistill.eval import engine
from specdistill.eval import stats as metrics
from tests.eval.helpers import N_NEW


def test_closed_forms():
    # Constant α: the rounds form a renewal process and τ is the i.i.d. formula.
    for alpha, gamma in [(0.5, 3), (0.8, 1), (0.3, 5)]:
        assert metrics.tau_rounds([alpha] * 4001, gamma) == pytest.approx(
            metrics.tau_iid(alpha, gamma), rel=1e-9
        )
        per_depth = [[alpha] * 4001] * gamma
        assert metrics.tau_rounds(per_depth, gamma) == pytest.approx(
            metrics.tau_iid(alpha, gamma), rel=1e-9
        )
    assert metrics.tau_rounds([1.0] * 11, 3) == 4.0
    assert metrics.tau_rounds([0.0] * 11, 3) == 1.0
    # Too short for one uncapped round (s + γ + 1 ≤ L): no prediction.
    assert math.isnan(metrics.tau_rounds([1.0] * 4, 3))
    with pytest.raises(ValueError, match="depths"):
        metrics.tau_rounds([[0.5] * 10] * 2, 3)


def test_round_boundaries_replayed():
    """Alternating α: the i.i.d. formula on the mean α = 0.5 gives 1.875 at γ = 3 either way;
    the rounds see only the positions they start on. L = 100, last counted start 96."""
    # Starts 0, 2, ..., 96: accept (α = 1), reject (α = 0), 2 tokens each.
    assert metrics.round_counts([1.0, 0.0] * 50 + [1.0], 3) == (98.0, 49.0)
    # Start 0 rejects (1 token), then starts 1, 3, ..., 95 commit 2 each.
    assert metrics.round_counts([0.0, 1.0] * 50 + [0.0], 3) == (97.0, 49.0)


def pooled_measured(rounds) -> float:
    return metrics.acceptance_stats(rounds)["tau"]


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_tau_rounds_equals_measured(perturbed_pair, prompts, gamma):
    """At T=0, α ∈ {0, 1} along the target's greedy text: the DP replays the engine."""
    target, draft = perturbed_pair
    out = engine.generate(target, draft, prompts, gamma=gamma, batch_size=1, max_new_tokens=N_NEW)
    greedy = engine.generate(target, None, prompts, max_new_tokens=N_NEW)
    assert greedy.sequences == out.sequences
    alphas = [
        metrics.positional_alpha(target, draft, p, o, temperature=0.0)
        for p, o in zip(prompts, greedy.sequences, strict=True)
    ]
    measured = pooled_measured(out.rounds)
    assert metrics.tau_rounds_pooled(alphas, gamma) == pytest.approx(measured, abs=1e-12)
    # The draft is neither perfect nor useless here, so the check is not vacuous.
    assert 1.0 < measured < gamma + 1


def test_sampled_tau_rounds_within_standard_errors(perturbed_pair):
    """At T=1 the prediction along target-sampled texts agrees with the engine's τ (other
    texts, same distribution) within 4 combined standard errors of the two ratio estimates."""
    target, draft = perturbed_pair
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 9, (40,), generator=g).tolist()
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]
    gamma, n_new = 3, 32
    measured = []  # per (seed, request): (tokens, rounds) of the counted rounds
    for seed in (0, 1):
        out = engine.generate(
            target,
            draft,
            prompts,
            gamma=gamma,
            temperature=1.0,
            max_new_tokens=n_new,
            seed=seed,
            batch_size=1,
        )
        per = {i: [0, 0] for i in range(len(prompts))}
        for r in out.rounds:
            if r.gamma > 0 and not r.capped:
                for request, committed in zip(r.requests, r.committed, strict=True):
                    per[request][0] += committed
                    per[request][1] += 1
        measured += per.values()
    predicted = []
    base = engine.generate(target, None, prompts, temperature=1.0, max_new_tokens=n_new, seed=9)
    for p, o in zip(prompts, base.sequences, strict=True):
        alphas = metrics.positional_alpha(target, draft, p, o, temperature=1.0)
        predicted.append(metrics.round_counts(alphas, gamma))

    def ratio(pairs):
        t, r = sum(a for a, _ in pairs), sum(b for _, b in pairs)
        tau = t / r
        return tau, math.sqrt(sum((a - tau * b) ** 2 for a, b in pairs)) / r

    tau, se_m = ratio(measured)
    pred, se_p = ratio(predicted)
    assert abs(tau - pred) <= 4 * math.hypot(se_m, se_p)
