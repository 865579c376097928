"""A top-N target with a rest bin for a draft over a truncated vocabulary V_d (d2t): the N
target ids compared in the draft's columns, those outside V_d left out as a dense target's
mass outside V_d is (docs/theory.md §3, losses/rest_bin.py)."""

import pytest
import torch

from specdistill.losses import LOSSES, SparseTarget, acceptance, compute_loss
from tests.losses.common import PARAMS

V, V_D = 12, 7
# draft column i is target id DRAFT_IDS[i]; ids 1, 4, 6, 8, 10 are outside V_d
DRAFT_IDS = torch.tensor([0, 2, 3, 5, 7, 9, 11])
D2T = DRAFT_IDS - torch.arange(V_D)


def pair(seed: int, rows: int = 6):
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(rows, V_D, generator=g, dtype=torch.float64) * 2
    target = torch.randn(rows, V, generator=g, dtype=torch.float64) * 2
    return draft, target


def top_n(target: torch.Tensor, n: int) -> SparseTarget:
    p = target.softmax(-1)
    probs, indices = p.topk(n, -1)
    # clamped as the cache writers do: 1 - Σ rounds to -2e-16 where the top N hold it all
    return SparseTarget(indices, probs, (1 - probs.sum(-1)).clamp_min(0))


@pytest.mark.parametrize("name", sorted(set(LOSSES) - {"ce", "topk_ce"}))
def test_every_target_token_stored_equals_the_dense_target(name):
    """N = V with rest 0: every loss, α and gradient equal the dense target's with d2t."""
    draft, target = pair(0)
    params = PARAMS.get(name, {})
    a = draft.clone().requires_grad_()
    dense, n_dense = compute_loss(name, a, target, d2t=D2T, **params)
    dense.backward()
    b = draft.clone().requires_grad_()
    sparse, n_sparse = compute_loss(name, b, top_n(target, V), d2t=D2T, **params)
    sparse.backward()
    torch.testing.assert_close(sparse, dense, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-12)
    assert n_sparse == n_dense
    torch.testing.assert_close(
        acceptance(draft, top_n(target, V), d2t=D2T), acceptance(draft, target, d2t=D2T)
    )


def test_fewer_tokens_give_the_coarsened_alpha_by_hand():
    draft, target = pair(1)
    sparse = top_n(target, 4)
    q, p = draft.softmax(-1), target.softmax(-1)
    to_column = {int(t): i for i, t in enumerate(DRAFT_IDS)}
    got = acceptance(draft, sparse, d2t=D2T)
    for r in range(len(draft)):
        kept = [to_column[int(t)] for t in sparse.indices[r] if int(t) in to_column]
        alpha = sum(min(p[r, DRAFT_IDS[c]], q[r, c]) for c in kept)
        alpha += min(1 - sparse.probs[r].sum(), q[r].sum() - q[r, kept].sum())
        assert got[r].item() == pytest.approx(float(alpha), abs=1e-12)
        # an upper bound of the true α over V_d (the tail's overlap counted as if matched)
        true = torch.minimum(p[r, DRAFT_IDS], q[r]).sum()
        assert got[r].item() >= true.item() - 1e-12


def test_a_row_stored_wholly_outside_the_draft_vocabulary_stays_finite():
    draft = torch.zeros(1, V_D, requires_grad=True)
    outside = SparseTarget(torch.tensor([[1, 4]]), torch.tensor([[0.75, 0.25]]), torch.zeros(1))
    for name in ("tv", "fkl", "lk_lambda", "rkl"):
        loss, n = compute_loss(name, draft, outside, d2t=D2T, **PARAMS.get(name, {}))
        assert torch.isfinite(loss) and n.item() == 1, name
        (grad,) = torch.autograd.grad(loss, draft)
        assert torch.isfinite(grad).all(), name
    assert acceptance(draft, outside, d2t=D2T).item() < 1e-30  # no mass to accept


def test_negative_target_ids_are_refused_at_valid_positions_only():
    draft = torch.zeros(2, V_D)
    sparse = SparseTarget(
        torch.tensor([[0, -3], [2, 3]]),
        torch.tensor([[0.5, 0.2], [0.5, 0.2]]),
        torch.full((2,), 0.3),
    )
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        compute_loss("tv", draft, sparse, d2t=D2T)
    loss, n = compute_loss("tv", draft, sparse, torch.tensor([False, True]), d2t=D2T)
    assert torch.isfinite(loss) and n.item() == 1
