"""benchmarks/vs_trl_gkd.py compares like with like: TRL's GKD loss at beta = 0 (lmbda = 0) is
specdistill's fkl over the same positions, divided once by their count. Skipped without TRL
(the `bench` extra)."""

import warnings

import pytest
import torch

from specdistill.losses import compute_loss

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # TRL's notice that trl.experimental may change
    gkd = pytest.importorskip("trl.experimental.gkd")


def test_gkd_at_beta_zero_is_fkl():
    generator = torch.Generator().manual_seed(0)
    draft = torch.randn(3, 7, 11, generator=generator, dtype=torch.float64, requires_grad=True)
    target = torch.randn(3, 7, 11, generator=generator, dtype=torch.float64) * 2
    mask = torch.rand(3, 7, generator=generator) > 0.4
    labels = torch.where(mask, 1, -100)  # GKD's mask: labels != -100
    theirs = gkd.GKDTrainer.generalized_jsd_loss(draft, target, labels=labels, beta=0.0)
    loss_sum, n_valid = compute_loss("fkl", draft, target, mask)
    ours = loss_sum / n_valid
    torch.testing.assert_close(ours, theirs)
    grads = [torch.autograd.grad(x, draft)[0] for x in (ours, theirs)]
    torch.testing.assert_close(*grads)
