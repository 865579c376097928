"""multi_depth_loss: per-depth weightings over K unrolled draft steps."""

import pytest
import torch

from specdistill.losses import acceptance, compute_loss, multi_depth_loss
from tests.losses.common import logits_of

K, B, S, V = 3, 2, 5, 7


def make(seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    draft = torch.randn(K, B, S, V, generator=generator, dtype=dtype)
    target = torch.randn(K, B, S, V, generator=generator, dtype=dtype) * 2
    masks = torch.rand(K, B, S, generator=generator) > 0.2
    return draft, target, masks


@pytest.mark.parametrize("name", ["fkl", "tv", "lk_lambda"])
def test_geometric_is_decayed_sum_of_depth_losses(name):
    draft, target, masks = make()
    loss, n, alpha = multi_depth_loss(name, draft, target, masks)
    expected = sum(0.8**k * compute_loss(name, draft[k], target[k], masks[k])[0] for k in range(K))
    torch.testing.assert_close(loss, expected)  # lk_lambda: ᾱ per depth
    assert n.item() == masks[0].sum().item()
    for k in range(K):
        assert alpha[k].item() == pytest.approx(acceptance(draft[k], target[k])[masks[k]].mean())
    # Lists and stacked tensors are the same input; decay is a parameter.
    listed, _, _ = multi_depth_loss(name, list(draft), list(target), list(masks), decay=0.5)
    expected = sum(0.5**k * compute_loss(name, draft[k], target[k], masks[k])[0] for k in range(K))
    torch.testing.assert_close(listed, expected)


def test_expected_length_weights_give_exact_gradient_of_expected_length_with_lk_alpha():
    draft, target, masks = make(1)
    draft.requires_grad_()
    loss, _, _ = multi_depth_loss("lk_alpha", draft, target, masks, weighting="expected_length")
    (grad,) = torch.autograd.grad(loss, draft)
    alpha = torch.stack([acceptance(draft[k], target[k], mask=masks[k]) for k in range(K)])
    expected_length = alpha.cumprod(0).sum()  # Σ_positions Σ_j Π_{i<=j} α_i
    (grad_e,) = torch.autograd.grad(expected_length, draft)
    torch.testing.assert_close(grad, -grad_e)


def test_expected_length_closed_form():
    # One position, two depths: α_0 = .5, α_1 = .7 (pairs from test_losses).
    # Weights: w_0 = α_0 + α_0 α_1 = .85, w_1 = α_0 α_1 = .35.
    draft = torch.stack([logits_of([0.25, 0.25, 0.5]), logits_of([0.3, 0.3, 0.4])])[:, None]
    target = torch.stack([logits_of([0.5, 0.5, 0.0]), logits_of([0.6, 0.3, 0.1])])[:, None]
    loss, n, alpha = multi_depth_loss("tv", draft, target, weighting="expected_length")
    assert loss.item() == pytest.approx(0.85 * 0.5 + 0.35 * 0.3)
    assert alpha.tolist() == pytest.approx([0.5, 0.7]) and n.item() == 1
    e2e, _, _ = multi_depth_loss("tv", draft, target, weighting="end_to_end")
    assert e2e.item() == pytest.approx(1 - (0.5 + 0.35) / 2)
    # A masked second depth ends the chain: α_1 counts as 0.
    masks = torch.tensor([[True], [False]])
    e2e, _, _ = multi_depth_loss("tv", draft, target, masks, weighting="end_to_end")
    assert e2e.item() == pytest.approx(1 - 0.5 / 2)
    weighted, _, _ = multi_depth_loss("tv", draft, target, masks, weighting="expected_length")
    assert weighted.item() == pytest.approx(0.5 * 0.5)


def test_end_to_end_with_one_depth_is_tv():
    draft, target, masks = make(2)
    e2e, n, _ = multi_depth_loss("tv", draft[:1], target[:1], masks[:1], weighting="end_to_end")
    tv, n_tv = compute_loss("tv", draft[0], target[0], masks[0])
    torch.testing.assert_close(e2e, tv)
    assert n == n_tv


@pytest.mark.parametrize("weighting", ["geometric", "expected_length", "end_to_end"])
def test_all_masked_and_disjoint_are_finite(weighting):
    draft, target, masks = make(3)
    draft = draft.clone().requires_grad_()
    loss, n, alpha = multi_depth_loss(
        "tv", draft, target, torch.zeros_like(masks), weighting=weighting
    )
    (grad,) = torch.autograd.grad(loss, draft)
    assert loss.item() == 0 and n.item() == 0 and torch.equal(alpha, torch.zeros(K))
    assert torch.equal(grad, torch.zeros_like(grad))
    far = torch.where(target > 0, -1e4, 0.0)  # q where p is small
    loss, _, _ = multi_depth_loss("tv", far.requires_grad_(), target, masks, weighting=weighting)
    (grad,) = torch.autograd.grad(loss, far)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


@pytest.mark.parametrize("name", ["fkl", "tv", "lk_lambda"])
def test_positions_masked_at_every_depth_do_not_matter(name):
    # Their rows are dropped before any work: NaN there changes nothing, their gradient is
    # exactly 0, and the rest equals the loss of each depth on the full rows.
    draft, target, masks = make(5)
    masks[:, 0, :2] = False  # valid at no depth
    masks[1:, 1, 3] = False  # valid at depth 0 only
    nowhere = ~masks.any(0)
    for weighting in ("geometric", "expected_length"):
        clean = draft.clone().requires_grad_()
        loss, n, alpha = multi_depth_loss(name, clean, target, masks, weighting=weighting)
        (grad,) = torch.autograd.grad(loss, clean)
        poisoned = draft.clone()
        poisoned[:, nowhere] = float("nan")
        poisoned_target = target.clone()
        poisoned_target[:, nowhere] = float("nan")
        poisoned.requires_grad_()
        loss_p, n_p, alpha_p = multi_depth_loss(
            name, poisoned, poisoned_target, masks, weighting=weighting
        )
        (grad_p,) = torch.autograd.grad(loss_p, poisoned)
        torch.testing.assert_close(loss_p, loss)
        torch.testing.assert_close(alpha_p, alpha)
        assert n_p == n == masks[0].sum()
        torch.testing.assert_close(grad_p, grad)
        assert torch.equal(grad[:, nowhere], torch.zeros_like(grad[:, nowhere]))
    expected = sum(0.8**k * compute_loss(name, draft[k], target[k], masks[k])[0] for k in range(K))
    torch.testing.assert_close(multi_depth_loss(name, draft, target, masks)[0], expected)


def test_float64_gradcheck():
    # expected_length's weights are a stop-gradient (finite differences would move them);
    # its gradient is checked against −∇E above.
    draft, target, masks = make(4)
    draft = draft[:, :1, :3].clone().requires_grad_()
    target, masks = target[:, :1, :3], masks[:, :1, :3]
    for weighting in ("geometric", "end_to_end"):
        assert torch.autograd.gradcheck(
            lambda d, w=weighting: multi_depth_loss("tv", d, target, masks, weighting=w)[0],
            (draft,),
            fast_mode=True,
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"weighting": "mean"}, "weighting must be one of"),
        ({"weighting": "end_to_end", "name": "fkl"}, "use name='tv'"),
        ({"weighting": "end_to_end", "decay": 0.5}, "decay is only used"),
        ({"masks": torch.ones(2, B, S, dtype=torch.bool)}, "same number"),
    ],
)
def test_bad_arguments(kwargs, match):
    draft, target, _ = make()
    name = kwargs.pop("name", "tv")
    with pytest.raises(ValueError, match=match):
        multi_depth_loss(name, draft, target, **kwargs)
