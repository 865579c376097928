import math

import pytest
import torch

from specdistill.eval.offline import summarise
from specdistill.eval.stats import tau_chain, tau_iid


def test_tau_pred_closed_form():
    assert tau_iid(0.0, 5) == 1.0
    assert tau_iid(1.0, 5) == 6.0
    assert math.isclose(tau_iid(0.5, 1), 1.5)
    assert math.isclose(tau_iid(0.8, 3), 1 + 0.8 + 0.64 + 0.512)
    with pytest.raises(ValueError, match="alpha must be in"):
        tau_iid(1.2, 3)
    # a draft that is its target sums Σ min(p, q) to 1 + rounding: clamped, not refused
    assert tau_iid(1.0000000071401398, 3) == 4.0 and tau_iid(-1e-9, 3) == 1.0


def test_summarise_and_empty():
    out = summarise(
        torch.tensor([3.0, 2.0, 4.0], dtype=torch.float64), temperature=1.0, max_gamma=3
    )
    assert out["alpha"] == 0.75 and out["alpha_greedy"] == 0.5 and out["n_positions"] == 4
    assert math.isclose(out["tau_pred"][3], tau_iid(0.75, 3))
    with pytest.raises(ValueError, match="no valid positions"):
        summarise(torch.zeros(3, dtype=torch.float64), temperature=1.0, max_gamma=3)


def test_tau_chain_multiplies_per_slot_alphas():
    assert tau_chain([0.8], 3) == pytest.approx(tau_iid(0.8, 3))  # the last α is reused
    assert tau_chain([0.5, 0.4], 3) == pytest.approx(1 + 0.5 + 0.5 * 0.4 + 0.5 * 0.4 * 0.4)
    assert tau_chain([0.9, 0.7], 0) == 1.0


def test_alpha_from_serving_counters_inverts_tau():
    """The engines' accepted / drafted rate is not α; alpha_from_counts recovers α from the
    mean acceptance length (1 + accepted / steps) at γ = drafted / steps."""
    from specdistill.eval.stats import alpha_from_counts, tau_iid

    alpha, gamma, steps = 0.73, 4, 1000
    accepted = (tau_iid(alpha, gamma) - 1) * steps
    assert alpha_from_counts(steps, gamma * steps, accepted) == pytest.approx(alpha, abs=1e-6)
    assert accepted / (gamma * steps) == pytest.approx(0.48, abs=0.01)  # the engines' rate
    with pytest.raises(ValueError, match="no speculative steps"):
        alpha_from_counts(0, 0, 0)


def test_summarise_reports_round_boundary_tau_beside_iid():
    sums = torch.tensor([3.0, 2.0, 4.0], dtype=torch.float64)
    plain = summarise(sums, temperature=1.0, max_gamma=3)
    assert plain["tau_pred"] == plain["tau_pred_iid"]
    out = summarise(sums, temperature=1.0, max_gamma=3, tau_rounds={1: 1.5, 2: 1.7})
    assert out["tau_pred_iid"] == plain["tau_pred"]
    # γ without a round-boundary value (texts too short) keep the i.i.d. one.
    assert out["tau_pred"] == {1: 1.5, 2: 1.7, 3: plain["tau_pred"][3]}


def test_tau_rounds_pred_equals_greedy_engine():
    """The trainer's path: the target's held-out greedy texts, then τ per γ from the draft's
    offline α along them, equals the engine's measured τ at T = 0 (batch size 1)."""
    from specdistill.eval import engine
    from specdistill.eval.offline import held_out_texts, tau_rounds_pred
    from specdistill.eval.stats import acceptance_stats
    from tests.eval.helpers import perturbed, tiny_llama

    target = tiny_llama(0, vocab=96, hidden=64, layers=2, init=0.2)
    draft = perturbed(target, 0.015, seed=1)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 11, 6)]
    outputs = held_out_texts(target, prompts, temperature=0.0, max_new_tokens=20)
    tau = tau_rounds_pred(target, draft, prompts, outputs, temperature=0.0, max_gamma=20)
    assert set(tau) == set(range(1, 20))  # γ = 20 leaves no uncapped round in 20 tokens
    for gamma in (1, 4):
        out = engine.generate(target, draft, prompts, gamma=gamma, batch_size=1, max_new_tokens=20)
        assert out.sequences == outputs
        assert tau[gamma] == pytest.approx(acceptance_stats(out.rounds)["tau"], abs=1e-12)
