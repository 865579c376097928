"""Greedy losslessness under rounding (eval/lossless.py): the near-tie bound."""

import pytest
import torch

from specdistill.eval.lossless import (
    ULPS,
    GreedyChecker,
    classify,
    first_divergence,
    reference_dtype,
)
from tests.eval.helpers import tiny_llama

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
