"""A draft whose logits are NaN (or +inf) accepts nothing: α = 0 at every temperature, and
the acceptance losses are NaN (so that training stops), never the α ≈ 1 / loss 0 of a NaN
comparison that picks the target's own probability."""

import math

import pytest
import torch

from specdistill.losses import acceptance, compute_loss
from specdistill.losses.chain import log_alpha_of
from specdistill.losses.divergences import log_acceptance


def logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("where", ["all", "one entry"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_a_non_finite_draft_accepts_nothing(where, bad, temperature):
    draft, target = logits(0), logits(1)
    if where == "all":
        draft.fill_(bad)
    else:
        draft[:, :, 3] = bad
    alpha = acceptance(draft, target, temperature, top_p=0.9 if temperature == 0.7 else None)
    assert torch.equal(alpha, torch.zeros(2, 5))


def test_an_all_minus_inf_draft_row_is_no_greedy_prediction():
    draft, target = logits(0), logits(1)
    draft[0, 0] = -math.inf
    target[0, 0, 0] = 50.0  # the target's argmax is the index an all −inf row's argmax gives
    assert acceptance(draft, target, 0.0)[0, 0] == 0.0


def test_nan_rows_only_zero_themselves():
    draft, target = logits(0), logits(1)
    healthy = acceptance(draft, target, 1.0)
    draft[1, 2] = math.nan
    alpha = acceptance(draft, target, 1.0)
    assert alpha[1, 2] == 0.0
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1, 2] = False
    assert torch.equal(alpha[keep], healthy[keep])


def test_log_alpha_is_nan_for_a_nan_draft():
    target = torch.log_softmax(logits(1), -1)
    draft = torch.full_like(target, math.nan)
    assert log_acceptance(draft, target).isnan().all()
    assert log_alpha_of(draft, target).isnan().all()
    # a healthy draft: unchanged, ties go to the draft (the gradient reaches it)
    q = torch.log_softmax(logits(0), -1).requires_grad_()
    log_acceptance(q, q.detach()).sum().backward()
    assert torch.all(q.grad != 0)


@pytest.mark.parametrize("name", ["tv", "lk_alpha", "lk_lambda", "fkl"])
def test_the_losses_of_a_nan_draft_are_nan_not_zero(name):
    draft, target = logits(0), logits(1)
    draft[0, 1] = math.nan
    loss, _ = compute_loss(name, draft, target)
    assert loss.isnan()
