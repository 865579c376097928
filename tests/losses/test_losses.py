"""compute_loss / acceptance: closed forms, gradients, masking, edge cases."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdistill.losses import LOSSES, acceptance, compute_loss
from tests.losses.common import DIVERGENCES, PARAMS, logits_of

P = [0.5, 0.5, 0.0]
Q = [0.25, 0.25, 0.5]


def loss_of(name, draft, target, mask=None, **kwargs):
    return compute_loss(name, draft, target, mask, **{**PARAMS.get(name, {}), **kwargs})


def grad_of(name, draft, target, mask=None, **kwargs):
    draft = draft.detach().clone().requires_grad_()
    loss, _ = loss_of(name, draft, target, mask, **kwargs)
    loss.backward()
    return draft.grad


# --- closed forms ------------------------------------------------------------------------


def test_closed_form_values():
    # α = min(.5,.25) + min(.5,.25) + min(0,.5) = 0.5
    # KL(p||q) = 2 · 0.5·log(0.5/0.25) = log 2
    q, p = logits_of(Q)[None], logits_of(P)[None]
    alpha, kl = 0.5, math.log(2)
    lam = math.exp(-3.0 * alpha)
    expected = {
        "fkl": kl,
        "tv": 1 - alpha,
        "lk_alpha": -math.log(alpha),
        "lk_lambda": lam * kl + (1 - lam) * (1 - alpha),
        # KL(q||p) with p = 0 floored at fp32 tiny: .5·log(.5/tiny) + 2·.25·log(.25/.5)
        "rkl": 0.5 * (math.log(0.5) - math.log(torch.finfo(torch.float32).tiny))
        + 0.5 * math.log(0.5),
        "ce": -math.log(0.25),  # argmax p = token 0 (first of the tie)
    }
    assert acceptance(q, p).item() == pytest.approx(alpha)
    for name, value in expected.items():
        loss, n_valid = compute_loss(name, q, p)
        assert loss.item() == pytest.approx(value, rel=1e-6), name
        assert n_valid.item() == 1 and n_valid.dtype == torch.int64


def test_closed_form_second_pair_and_batch_mean_lambda():
    # p = [.6,.3,.1], q = [.3,.3,.4]: α = .3+.3+.1 = .7, KL = .6 log 2 + .1 log(.25)
    # Batch with the first pair and this one: ᾱ = (.5 + .7) / 2 = .6.
    p2, q2 = [0.6, 0.3, 0.1], [0.3, 0.3, 0.4]
    target = torch.stack([logits_of(P), logits_of(p2)])
    draft = torch.stack([logits_of(Q), logits_of(q2)])
    alphas, kls = [0.5, 0.7], [math.log(2), 0.6 * math.log(2) + 0.1 * math.log(0.25)]
    assert acceptance(draft, target).tolist() == pytest.approx(alphas)
    assert compute_loss("fkl", draft, target)[0].item() == pytest.approx(sum(kls))
    assert compute_loss("tv", draft, target)[0].item() == pytest.approx(0.8)
    lam = math.exp(-3.0 * 0.6)
    expected = sum(lam * kl + (1 - lam) * (1 - a) for a, kl in zip(alphas, kls, strict=True))
    assert compute_loss("lk_lambda", draft, target)[0].item() == pytest.approx(expected)
    # eta=1, ᾱ over valid positions only: masking the second pair leaves ᾱ = .5
    mask = torch.tensor([True, False])
    lam = math.exp(-0.5)
    loss, n = compute_loss("lk_lambda", draft, target, mask, eta=1.0)
    assert loss.item() == pytest.approx(lam * kls[0] + (1 - lam) * 0.5) and n.item() == 1


def test_lk_lambda_token_mode_uses_each_positions_alpha():
    target = torch.stack([logits_of(P), logits_of([0.6, 0.3, 0.1])])
    draft = torch.stack([logits_of(Q), logits_of([0.3, 0.3, 0.4])])
    per_token = 0.0
    for a, kl in [(0.5, math.log(2)), (0.7, 0.6 * math.log(2) + 0.1 * math.log(0.25))]:
        lam = math.exp(-3.0 * a)
        per_token += lam * kl + (1 - lam) * (1 - a)
    loss, _ = compute_loss("lk_lambda", draft, target, lambda_mode="token")
    assert loss.item() == pytest.approx(per_token)


def test_mixture_equals_weighted_sum():
    torch.manual_seed(0)
    draft, target = torch.randn(3, 4, 7), torch.randn(3, 4, 7)
    mask = torch.rand(3, 4) > 0.3
    parts = {"tv": 0.9, "fkl": 0.1, "lk_lambda": 0.5, "jsd": 0.25}
    own_params = {"lk_lambda": {"eta": 2.0}, "jsd": {"beta": 0.4}}
    mixed, n = compute_loss("mix", draft, target, mask, parts=parts, eta=2.0, beta=0.4)
    expected = sum(
        weight * compute_loss(name, draft, target, mask, **own_params.get(name, {}))[0]
        for name, weight in parts.items()
    )
    torch.testing.assert_close(mixed, expected)
    assert n == mask.sum()


# --- gradients ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_gradcheck_float64(name):
    torch.manual_seed(1)
    draft = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    target = torch.randn(2, 3, 5, dtype=torch.float64)
    target[0, 0, 1] = -math.inf  # a p = 0 entry
    mask = torch.tensor([[True, True, False], [True, False, True]])
    params = dict(PARAMS.get(name, {}))
    if name in ("lk_lambda", "mix"):
        # λ is a stop-gradient of ᾱ; finite differences would move it, so pin it.
        params["alpha_bar"] = 0.4
    assert torch.autograd.gradcheck(
        lambda d: compute_loss(name, d, target, mask, **params)[0], (draft,)
    )


def test_lk_lambda_gradient_is_lambda_mix_of_kl_and_tv_gradients():
    torch.manual_seed(2)
    draft, target = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    alpha = acceptance(draft, target)
    g_kl = torch.stack([grad_of("fkl", draft[i : i + 1], target[i : i + 1])[0] for i in range(6)])
    g_tv = torch.stack([grad_of("tv", draft[i : i + 1], target[i : i + 1])[0] for i in range(6)])
    for mode, lam in [("batch", torch.exp(-3 * alpha.mean())), ("token", torch.exp(-3 * alpha))]:
        lam = lam.reshape(-1, 1) if lam.dim() else lam
        expected = lam * g_kl + (1 - lam) * g_tv
        torch.testing.assert_close(grad_of("lk_lambda", draft, target, lambda_mode=mode), expected)


def test_tv_gradient_closed_form():
    # ∂TV/∂z_x = −q(x)·(1[q(x) ≤ p(x)] − s), s = Σ_{q ≤ p} q.
    torch.manual_seed(3)
    draft, target = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    q, p = draft.softmax(-1), target.softmax(-1)
    below = (q <= p).to(q.dtype)
    s = (q * below).sum(-1, keepdim=True)
    torch.testing.assert_close(grad_of("tv", draft, target), -q * (below - s))


def test_fkl_gradient_is_q_minus_p():
    torch.manual_seed(4)
    draft, target = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    torch.testing.assert_close(
        grad_of("fkl", draft, target), draft.softmax(-1) - target.softmax(-1)
    )


def test_lk_alpha_gradient_is_tv_gradient_over_alpha():
    torch.manual_seed(5)
    draft, target = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    alpha = acceptance(draft, target)[:, None]
    g_tv = torch.stack([grad_of("tv", draft[i : i + 1], target[i : i + 1])[0] for i in range(4)])
    torch.testing.assert_close(grad_of("lk_alpha", draft, target), g_tv / alpha)


def test_lk_alpha_equals_ce_for_one_hot_target():
    torch.manual_seed(6)
    draft = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 3, 5, 3])
    one_hot = torch.full((4, 6), -math.inf, dtype=torch.float64)
    one_hot[torch.arange(4), labels] = 0.0
    expected = torch.nn.functional.cross_entropy(draft, labels, reduction="sum")
    expected_grad = torch.autograd.grad(expected, draft)[0]
    for name in ("lk_alpha", "ce", "fkl"):
        loss, _ = compute_loss(name, draft, one_hot)
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close(torch.autograd.grad(loss, draft)[0], expected_grad)
    peaked = torch.zeros(4, 6, dtype=torch.float64).scatter(1, labels[:, None], 100.0)
    torch.testing.assert_close(compute_loss("lk_alpha", draft, peaked)[0], expected)


# --- edge cases --------------------------------------------------------------------------


@pytest.mark.parametrize("name", DIVERGENCES)
def test_identical_distributions_give_alpha_one_and_minimum(name):
    torch.manual_seed(7)
    logits = torch.randn(3, 4, 9)
    torch.testing.assert_close(acceptance(logits, logits), torch.ones(3, 4))
    loss, n = loss_of(name, logits, logits)
    assert n.item() == 12
    assert abs(loss.item()) < 1e-5
    assert grad_of(name, logits, logits).abs().max() < 1e-6


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("target_off_support", [-math.inf, -1e4])
def test_disjoint_supports_give_finite_loss_and_grad(name, target_off_support):
    target = torch.tensor([[0.0, 0.0, target_off_support, target_off_support]])
    draft = torch.tensor([[-1e4, -1e4, 0.0, 0.0]])
    assert acceptance(draft, target).item() == 0.0
    loss, _ = loss_of(name, draft, target)
    assert torch.isfinite(loss) and loss.item() > 0
    assert torch.isfinite(grad_of(name, draft, target)).all()


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_all_masked_gives_zero_loss_and_zero_grad(name):
    draft = torch.full((2, 3, 5), math.nan)
    target = torch.full((2, 3, 5), math.inf)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    loss, n = loss_of(name, draft, target, mask)
    assert loss.item() == 0.0 and n.item() == 0
    grad = grad_of(name, draft, target, mask)
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_masked_positions_do_not_affect_result(name):
    torch.manual_seed(8)
    draft, target = torch.randn(2, 5, 6), torch.randn(2, 5, 6)
    mask = torch.tensor([[True, False, True, True, False], [False, True, True, False, True]])
    poisoned_draft, poisoned_target = draft.clone(), target.clone()
    poisoned_draft[~mask] = math.nan
    poisoned_target[~mask] = math.nan
    loss, n = loss_of(name, poisoned_draft, poisoned_target, mask)
    loss_valid, n_valid = loss_of(name, draft[mask], target[mask])
    torch.testing.assert_close(loss, loss_valid)
    assert n.item() == n_valid.item() == 6
    grad = grad_of(name, poisoned_draft, poisoned_target, mask)
    assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))
    torch.testing.assert_close(grad[mask], grad_of(name, draft[mask], target[mask]))


def test_temperature_scales_both_sides():
    torch.manual_seed(9)
    draft, target = torch.randn(4, 7), torch.randn(4, 7)
    for name in ("fkl", "tv", "lk_alpha", "lk_lambda"):
        hot, _ = compute_loss(name, draft, target, temperature=2.5)
        torch.testing.assert_close(hot, compute_loss(name, draft / 2.5, target / 2.5)[0])
    torch.testing.assert_close(
        acceptance(draft, target, temperature=0.5), acceptance(draft * 2, target * 2)
    )


def test_temperature_zero_acceptance_is_argmax_agreement():
    draft = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 0.0, 5.0]])
    target = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 9.0], [-1.0, 0.0, 0.0]])
    target[2, 2] = 0.5
    alpha = acceptance(draft, target, temperature=0)
    assert alpha.tolist() == [1.0, 0.0, 1.0] and alpha.dtype == torch.float32


def test_fp32_inside_for_half_inputs_and_target_is_constant():
    torch.manual_seed(10)
    draft = torch.randn(4, 6).to(torch.bfloat16).requires_grad_()
    target = torch.randn(4, 6).to(torch.bfloat16).requires_grad_()
    loss, _ = compute_loss("lk_lambda", draft, target)
    assert loss.dtype == torch.float32
    reference, _ = compute_loss("lk_lambda", draft.detach().float(), target.detach().float())
    torch.testing.assert_close(loss, reference)
    loss.backward()
    assert target.grad is None and draft.grad.dtype == torch.bfloat16


def test_any_leading_shape():
    torch.manual_seed(11)
    draft, target = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    for name in ("fkl", "tv", "lk_alpha", "lk_lambda"):
        loss, n = compute_loss(name, draft, target)
        flat, _ = compute_loss(name, draft.reshape(-1, 5), target.reshape(-1, 5))
        torch.testing.assert_close(loss, flat)
        assert n.item() == 24
    assert acceptance(draft, target).shape == (2, 3, 4)


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda d, t: compute_loss("kl", d, t), "unknown loss 'kl'; valid names"),
        (lambda d, t: compute_loss("fkl", d, t, eta=3.0), r"unknown params \['eta'\]"),
        (lambda d, t: compute_loss("tv", d, t, temperature=0.0), "temperature must be > 0"),
        (lambda d, t: compute_loss("tv", d, t, temperature=-1.0), "temperature must be > 0"),
        (lambda d, t: compute_loss("lk_lambda", d, t, lambda_mode="x"), "lambda_mode"),
        (lambda d, t: compute_loss("lk_lambda", d, t, eta=-1.0), "eta must be >= 0"),
        (lambda d, t: compute_loss("mix", d, t, parts={"tv": 1.0, "nope": 1.0}), "unknown parts"),
        (lambda d, t: compute_loss("mix", d, t, parts={"tv": 1.0}, beta=0.5), "unknown params"),
        (lambda d, t: compute_loss("tv", d, t[:, :3]), "target vocab 3 != draft vocab 4"),
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.randn(2, 4), torch.randn(2, 4))


@pytest.mark.parametrize("bad", [math.nan, math.inf, "all -inf"])
def test_non_finite_target_at_valid_position_raises(bad):
    draft, target = torch.randn(3, 4), torch.randn(3, 4)
    if bad == "all -inf":
        target[1] = -math.inf
    else:
        target[1, 2] = bad
    with pytest.raises(ValueError, match="target logits are non-finite at 1 valid position"):
        compute_loss("fkl", draft, target)
    loss, n = compute_loss("fkl", draft, target, torch.tensor([True, False, True]))
    assert torch.isfinite(loss) and n.item() == 2


# --- properties --------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(1, 12),
    rows=st.integers(1, 4),
    temperature=st.floats(0.1, 5.0),
    seed=st.integers(0, 2**16),
    scale=st.floats(0.1, 20.0),
)
def test_acceptance_properties(vocab, rows, temperature, seed, scale):
    generator = torch.Generator().manual_seed(seed)
    draft = torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * scale
    target = torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * scale
    alpha = acceptance(draft, target, temperature)
    assert ((alpha >= 0) & (alpha <= 1 + 1e-12)).all()
    torch.testing.assert_close(alpha, acceptance(target, draft, temperature))
    p, q = (target / temperature).softmax(-1), (draft / temperature).softmax(-1)
    torch.testing.assert_close(alpha, 1 - 0.5 * (p - q).abs().sum(-1))
    tv, _ = compute_loss("tv", draft, target, temperature=temperature)
    torch.testing.assert_close(tv, (1 - alpha).sum())


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(LOSSES)),
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    vocab=st.integers(2, 12),
    temperature=st.floats(0.2, 4.0),
    seed=st.integers(0, 2**16),
)
def test_loss_properties(name, shape, vocab, temperature, seed):
    generator = torch.Generator().manual_seed(seed)
    draft = torch.randn(*shape, vocab, generator=generator, dtype=torch.float64) * 4
    target = torch.randn(*shape, vocab, generator=generator, dtype=torch.float64) * 4
    mask = torch.rand(*shape, generator=generator) > 0.4
    loss, n = loss_of(name, draft, target, mask, temperature=temperature)
    assert torch.isfinite(loss) and n.item() == mask.sum().item()
    if name in DIVERGENCES:
        assert loss.item() >= -1e-9
    subset, _ = loss_of(name, draft[mask], target[mask], temperature=temperature)
    torch.testing.assert_close(loss, subset)


# --- individual divergences --------------------------------------------------------------


def test_jsd_closed_form_and_end_points():
    # β = 0.5: m = [.375, .375, .25]; KL(p||m) = log(4/3), KL(q||m) = ½ log(4/3);
    # jsd_0.5 = 4·JS = 4·½(log(4/3) + ½ log(4/3)) = 3 log(4/3).
    q, p = logits_of(Q)[None], logits_of(P)[None]
    jsd_half, _ = compute_loss("jsd", q, p, beta=0.5)
    assert jsd_half.item() == pytest.approx(3 * math.log(4 / 3))
    torch.manual_seed(12)
    draft, target = torch.randn(5, 7, dtype=torch.float64), torch.randn(5, 7, dtype=torch.float64)
    fkl, _ = compute_loss("fkl", draft, target)
    rkl, _ = compute_loss("rkl", draft, target)
    # End points are exactly the two KLs, and jsd is continuous into them.
    assert compute_loss("jsd", draft, target, beta=0.0)[0].item() == fkl.item()
    assert compute_loss("jsd", draft, target, beta=1.0)[0].item() == rkl.item()
    near_0, _ = compute_loss("jsd", draft, target, beta=1e-5)
    near_1, _ = compute_loss("jsd", draft, target, beta=1 - 1e-5)
    assert near_0.item() == pytest.approx(fkl.item(), rel=1e-3)
    assert near_1.item() == pytest.approx(rkl.item(), rel=1e-3)
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
        compute_loss("jsd", draft, target, beta=1.5)


def test_topk_ce_closed_form():
    # Top-2 of p = [.5, .3, .2] renormalised: [.625, .375].
    q = [0.2, 0.5, 0.3]
    loss, _ = compute_loss("topk_ce", logits_of(q)[None], logits_of([0.5, 0.3, 0.2])[None], k=2)
    assert loss.item() == pytest.approx(-(0.625 * math.log(0.2) + 0.375 * math.log(0.5)))
    with pytest.raises(ValueError, match="k must be in"):
        compute_loss("topk_ce", logits_of(q)[None], logits_of(q)[None], k=4)
