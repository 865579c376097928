"""Target forms and sampling parameters: probabilities, top-k / top-p filtering,
truncated draft vocabulary (d2t), sparse top-N targets."""

import math

import pytest
import torch

from specdistill.losses import LOSSES, SparseTarget, acceptance, compute_loss
from tests.losses.common import PARAMS, logits_of


def kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True) if a > 0)


def test_top_k_filters_the_target_only():
    # top_k=2 keeps p on tokens {0, 2}: softmax([3, 2]).
    target = torch.tensor([[3.0, 1.0, 2.0, 0.0]], dtype=torch.float64)
    draft = torch.zeros(1, 4, dtype=torch.float64)  # q uniform, left unfiltered
    p0 = 1 / (1 + math.exp(-1))
    p = [p0, 0.0, 1 - p0, 0.0]
    assert acceptance(draft, target, top_k=2).item() == pytest.approx(0.5)
    assert compute_loss("fkl", draft, target, top_k=2)[0].item() == pytest.approx(kl(p, [0.25] * 4))
    # top_k >= vocab filters nothing.
    torch.testing.assert_close(acceptance(draft, target, top_k=4), acceptance(draft, target))


def test_top_p_applies_after_temperature():
    # p = [.5, .3, .15, .05]. At T=2, p ∝ sqrt(p) = [.379, .294, .208, .120]: top_p=0.45 keeps
    # {0, 1} (mass before token 1 is .379). Filtering before tempering would keep {0} only.
    target = logits_of([0.5, 0.3, 0.15, 0.05])[None]
    draft = torch.zeros(1, 4, dtype=torch.float64)
    assert acceptance(draft, target, temperature=2.0, top_p=0.45).item() == pytest.approx(0.5)
    sqrt_p = [math.sqrt(x) for x in (0.5, 0.3)]
    p = [x / sum(sqrt_p) for x in sqrt_p] + [0.0, 0.0]
    loss, _ = compute_loss("fkl", draft, target, temperature=2.0, top_p=0.45)
    assert loss.item() == pytest.approx(kl(p, [0.25] * 4))
    # At T=1 the same top_p keeps only token 0.
    assert acceptance(draft, target, top_p=0.45).item() == pytest.approx(0.25)
    torch.testing.assert_close(acceptance(draft, target, top_p=1.0), acceptance(draft, target))


@pytest.mark.parametrize("kwargs, match", [({"top_p": 0.0}, "top_p"), ({"top_k": 0}, "top_k")])
def test_bad_filters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_loss("tv", torch.randn(2, 4), torch.randn(2, 4), **kwargs)


# --- truncated draft vocabulary ----------------------------------------------------------

# Target vocab 6; the draft's 3 tokens are target ids [1, 3, 4]: d2t = ids - arange(3).
D2T = torch.tensor([1, 2, 2])
TARGET_P = [0.1, 0.3, 0.05, 0.2, 0.15, 0.2]  # argmax 1, in V_d; mass on V_d = .65
OUTSIDE_P = [0.4, 0.2, 0.1, 0.1, 0.1, 0.1]  # argmax 0, outside V_d; mass on V_d = .4
DRAFT_Q = [0.2, 0.5, 0.3]


def test_truncated_vocab_alpha_uses_raw_p_and_kl_renormalised_p():
    draft, target = logits_of(DRAFT_Q)[None], logits_of(TARGET_P)[None]
    raw = [0.3, 0.2, 0.15]
    alpha = sum(min(a, b) for a, b in zip(raw, DRAFT_Q, strict=True))  # .2 + .2 + .15 = .55
    renormalised = [x / 0.65 for x in raw]
    assert acceptance(draft, target, d2t=D2T).item() == pytest.approx(alpha)
    expected = {
        "tv": 1 - alpha,
        "lk_alpha": -math.log(alpha),
        "fkl": kl(renormalised, DRAFT_Q),
        "ce": -math.log(DRAFT_Q[0]),
    }
    for name, value in expected.items():
        assert compute_loss(name, draft, target, d2t=D2T)[0].item() == pytest.approx(value)


def test_truncated_vocab_masks_positions_whose_argmax_is_outside():
    draft = torch.stack([logits_of(DRAFT_Q)] * 2)
    target = torch.stack([logits_of(TARGET_P), logits_of(OUTSIDE_P)])
    both, n_both = compute_loss("tv", draft, target, d2t=D2T)
    inside, n_inside = compute_loss("tv", draft, target, d2t=D2T, mask_out_of_vocab=True)
    assert (n_both.item(), n_inside.item()) == (2, 1)
    assert inside.item() == pytest.approx(1 - 0.55)
    # Outside row: α = min(.2,.2) + min(.1,.5) + min(.1,.3) = .4
    assert both.item() == pytest.approx(1 - 0.55 + 1 - 0.4)
    with pytest.raises(ValueError, match="mask_out_of_vocab needs d2t"):
        compute_loss("tv", draft, target[:, :3], mask_out_of_vocab=True)


def test_truncated_vocab_greedy_acceptance_maps_draft_ids():
    # Draft argmax is draft id 1 = target id 3.
    draft = logits_of(DRAFT_Q)[None]
    agrees = logits_of([0.1, 0.1, 0.1, 0.5, 0.1, 0.1])[None]
    assert acceptance(draft, agrees, temperature=0, d2t=D2T).item() == 1.0
    assert acceptance(draft, logits_of(TARGET_P)[None], temperature=0, d2t=D2T).item() == 0.0


def test_target_without_mass_on_draft_vocab_raises_unless_masked():
    draft = torch.stack([logits_of(DRAFT_Q)] * 2)
    target = torch.stack([logits_of(TARGET_P), logits_of([0.5, 0.0, 0.5, 0.0, 0.0, 0.0])])
    with pytest.raises(
        ValueError, match=r"no probability mass \(max p < 1e-38\) on the draft vocabulary at 1"
    ):
        compute_loss("lk_alpha", draft, target, d2t=D2T)
    loss, n = compute_loss("lk_alpha", draft, target, d2t=D2T, mask_out_of_vocab=True)
    assert loss.item() == pytest.approx(-math.log(0.55)) and n.item() == 1


# --- sparse targets ----------------------------------------------------------------------


def test_sparse_target_alpha_is_exact_for_truncated_target():
    # p = .75 on token 2, .25 on token 0 (given unnormalised: renormalised over the top-N).
    sparse = SparseTarget(torch.tensor([[2, 0]]), torch.tensor([[0.6, 0.2]]))
    draft = logits_of([0.1, 0.2, 0.3, 0.4])[None]
    assert acceptance(draft, sparse).item() == pytest.approx(0.1 + 0.3)
    assert compute_loss("tv", draft, sparse)[0].item() == pytest.approx(0.6)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_sparse_target_equals_dense_target_with_zeros(name):
    torch.manual_seed(20)
    draft = torch.randn(3, 4, 10, dtype=torch.float64)
    probs, indices = torch.rand(3, 4, 3, dtype=torch.float64).add(0.1), torch.randperm(10)[:3]
    indices = indices.expand(3, 4, 3)
    probs = probs / probs.sum(-1, keepdim=True)
    dense = torch.full((3, 4, 10), -math.inf, dtype=torch.float64).scatter(-1, indices, probs.log())
    mask = torch.rand(3, 4) > 0.3
    for kwargs in ({}, {"temperature": 1.7, "top_k": 2}):
        sparse_loss = compute_loss(
            name, draft, SparseTarget(indices, probs), mask, **kwargs, **PARAMS.get(name, {})
        )
        dense_loss = compute_loss(name, draft, dense, mask, **kwargs, **PARAMS.get(name, {}))
        torch.testing.assert_close(sparse_loss, dense_loss)


def test_sparse_target_with_truncated_vocab_and_greedy():
    # Target ids 3 (p=.7) and 0 (p=.3); draft tokens are target ids [1, 3, 4].
    sparse = SparseTarget(torch.tensor([[3, 0]]), torch.tensor([[0.7, 0.3]]))
    draft = logits_of(DRAFT_Q)[None]
    assert acceptance(draft, sparse, d2t=D2T).item() == pytest.approx(0.5)  # min(.7, .5)
    assert acceptance(draft, sparse, temperature=0, d2t=D2T).item() == 1.0
    loss, n = compute_loss("fkl", draft, sparse, d2t=D2T, mask_out_of_vocab=True)
    assert loss.item() == pytest.approx(-math.log(0.5)) and n.item() == 1
