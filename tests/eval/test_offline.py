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
