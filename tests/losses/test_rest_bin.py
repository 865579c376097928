"""SparseTarget with a rest bin (docs/theory.md §3): the target's top-N probabilities plus the
mass it drops, compared with the draft on N + 1 bins (the draft's mass off the N tokens
summed into the rest bin)."""

import math

import pytest
import torch

from specdistill.losses import (
    LOSSES,
    SparseTarget,
    acceptance,
    chunked_loss,
    compute_loss,
    multi_depth_loss,
)
from tests.losses.common import PARAMS, logits_of

# Vocabulary 5. The target keeps tokens 2 and 0 (p .35 and .05) and drops .6, more than any
# kept token: the rest bin is the coarsened p's argmax, which ce / topk_ce must not pick.
Q = [0.15, 0.25, 0.3, 0.1, 0.2]
SPARSE = SparseTarget(
    torch.tensor([[2, 0]]),
    torch.tensor([[0.35, 0.05]], dtype=torch.float64),
    torch.tensor([0.6], dtype=torch.float64),
)
P_C = [0.35, 0.05, 0.6]  # coarsened target: token 2, token 0, rest
Q_C = [0.3, 0.15, 0.55]  # coarsened draft: q(2), q(0), q(1) + q(3) + q(4)


def kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True) if a > 0)


def jsd(p, q, beta):
    m = [beta * a + (1 - beta) * b for a, b in zip(p, q, strict=True)]
    return (beta * kl(p, m) + (1 - beta) * kl(q, m)) / (beta * (1 - beta))


def test_rest_bin_values_equal_a_hand_computation():
    draft = logits_of(Q)[None]
    alpha = sum(min(a, b) for a, b in zip(P_C, Q_C, strict=True))  # .3 + .05 + .55
    assert alpha == pytest.approx(0.9)
    fkl = kl(P_C, Q_C)
    lam = math.exp(-3.0 * alpha)
    expected = {
        "tv": 1 - alpha,
        "lk_alpha": -math.log(alpha),
        "fkl": fkl,
        "rkl": kl(Q_C, P_C),
        "jsd": jsd(P_C, Q_C, 0.3),
        "lk_lambda": lam * fkl + (1 - lam) * (1 - alpha),
        "ce": -math.log(0.3),  # token 2, the most probable token; not the rest bin
        # top 2 tokens {2, 0} renormalised: .875, .125 (not the rest bin and token 2)
        "topk_ce": -(0.875 * math.log(0.3) + 0.125 * math.log(0.15)),
    }
    expected["mix"] = 0.7 * expected["tv"] + 0.2 * expected["fkl"] + 0.1 * expected["lk_lambda"]
    assert set(expected) == set(LOSSES)
    for name, value in expected.items():
        loss, n = compute_loss(name, draft, SPARSE, **PARAMS.get(name, {}))
        assert loss.item() == pytest.approx(value, rel=1e-9), name
        assert n.item() == 1
    mixed, _ = compute_loss("mix", draft, SPARSE, parts={"ce": 0.5, "tv": 0.5})
    assert mixed.item() == pytest.approx(0.5 * -math.log(0.3) + 0.5 * (1 - alpha))
    assert acceptance(draft, SPARSE).item() == pytest.approx(alpha)
    assert acceptance(draft, SPARSE, temperature=0).item() == 1.0  # argmax q = argmax p = 2


def test_rest_bin_gradient_spreads_over_the_tail_by_q():
    # d fkl_c / d z_x = q(x) − p_c(x) on the kept tokens and q(x)·(1 − p_rest / q_rest) off them.
    draft = logits_of(Q)[None].requires_grad_(True)
    (grad,) = torch.autograd.grad(compute_loss("fkl", draft, SPARSE)[0], draft)
    p_kept = {2: 0.35, 0: 0.05}
    expected = [Q[x] - p_kept[x] if x in p_kept else Q[x] * (1 - P_C[2] / Q_C[2]) for x in range(5)]
    torch.testing.assert_close(grad[0], torch.tensor(expected, dtype=torch.float64))


def _random(seed, shape=(3, 4), vocab=12, n=4):
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * 2
    full = (torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * 2).softmax(-1)
    probs, indices = full.topk(n, dim=-1)
    mask = torch.rand(shape, generator=g) > 0.3
    return draft, full, probs, indices, mask


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_rest_bin_is_exact_when_nothing_is_dropped(name):
    """N = V: the rest (rounding) is ignored and the loss is the full target's. N < V with
    rest = 0: the loss (and gradient) is that of the sparse target without a rest bin, i.e.
    of the dense p that is 0 off the N tokens; except rkl, whose value at p = 0 is a floored
    stand-in for +inf (Σ q·(log q − floor) over the tail needs q per tail token)."""
    params = PARAMS.get(name, {})
    draft, full, _, _, mask = _random(0)
    draft = draft.requires_grad_(True)
    poisoned = draft.detach().clone()
    poisoned[~mask] = math.nan
    vocab = draft.shape[-1]
    indices = torch.arange(vocab).expand_as(full)
    rounding = torch.full(mask.shape, 1e-3, dtype=torch.float64)
    whole = compute_loss(name, draft, full.log(), mask, **params)[0]
    cached = compute_loss(name, draft, SparseTarget(indices, full, rounding), mask, **params)[0]
    torch.testing.assert_close(cached, whole)
    grads = [torch.autograd.grad(x, draft)[0] for x in (whole, cached)]
    torch.testing.assert_close(*grads)
    masked_nan = compute_loss(name, poisoned, SparseTarget(indices, full, rounding), mask, **params)
    torch.testing.assert_close(masked_nan[0], whole.detach())

    _, _, probs, indices, _ = _random(1)
    probs = probs / probs.sum(-1, keepdim=True)
    zero = torch.zeros(mask.shape, dtype=torch.float64)
    with_rest = compute_loss(name, draft, SparseTarget(indices, probs, zero), mask, **params)[0]
    without = compute_loss(name, draft, SparseTarget(indices, probs), mask, **params)[0]
    if name == "rkl":
        assert with_rest.item() != pytest.approx(without.item())
        return
    torch.testing.assert_close(with_rest, without)
    grads = [torch.autograd.grad(x, draft)[0] for x in (with_rest, without)]
    torch.testing.assert_close(*grads)


def test_coarsened_alpha_and_kl_bound_the_true_ones():
    """Coarsening can only merge mass: Σ_{top N} min(p, q) ≤ α ≤ α on the N + 1 bins, and KL on
    the bins ≤ KL (data processing); the bin values equal a dense computation on the bins."""
    draft, full, probs, indices, mask = _random(2, vocab=40, n=6)
    rest = 1 - probs.sum(-1)
    sparse = SparseTarget(indices, probs, rest)
    q = draft.softmax(-1)
    q_top = q.gather(-1, indices)
    lower = torch.minimum(probs, q_top).sum(-1)
    true_alpha = acceptance(draft, full.log())
    coarse_alpha = acceptance(draft, sparse)
    assert (lower <= true_alpha + 1e-12).all() and (true_alpha <= coarse_alpha + 1e-12).all()
    assert (coarse_alpha > true_alpha + 1e-3).any()  # strictly looser somewhere
    p_bins = torch.cat([probs, rest[..., None]], -1)
    q_bins = torch.cat([q_top, 1 - q_top.sum(-1, keepdim=True)], -1)
    torch.testing.assert_close(coarse_alpha, torch.minimum(p_bins, q_bins).sum(-1))
    coarse_kl = compute_loss("fkl", draft, sparse, mask)[0]
    by_hand = (p_bins * (p_bins / q_bins).log()).sum(-1)[mask].sum()
    torch.testing.assert_close(coarse_kl, by_hand)
    assert coarse_kl <= compute_loss("fkl", draft, full.log(), mask)[0]


@pytest.mark.parametrize("name", ["fkl", "tv", "lk_lambda", "topk_ce", "mix"])
def test_rest_bin_through_chunked_and_multi_depth(name):
    params = PARAMS.get(name, {})
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    _, _, probs, indices, mask = _random(3, shape=(2, 7), vocab=11, n=3)
    sparse = SparseTarget(indices, probs, 1 - probs.sum(-1))
    direct = compute_loss(name, hidden @ head.T, sparse, mask, **params)[0]
    chunked = chunked_loss(name, hidden, head, sparse, mask, chunk_size=4, **params)[0]
    torch.testing.assert_close(chunked, direct)
    for a, b in zip(
        torch.autograd.grad(direct, (hidden, head)),
        torch.autograd.grad(chunked, (hidden, head)),
        strict=True,
    ):
        torch.testing.assert_close(a, b)
    # two depths, one SparseTarget with [K, ...] fields
    drafts = torch.stack([hidden @ head.T, (hidden @ head.T).flip(-1)]).detach()
    stacked = SparseTarget(
        torch.stack([indices, indices.flip(0)]),
        torch.stack([probs, probs.flip(0)]),
        torch.stack([sparse.rest, sparse.rest.flip(0)]),
    )
    masks = torch.stack([mask, mask.flip(0)])
    loss, _, alpha = multi_depth_loss(name, drafts, stacked, masks, **params)
    per_depth = [SparseTarget(*(field[k] for field in stacked)) for k in range(2)]
    expected = sum(
        0.8**k * compute_loss(name, drafts[k], per_depth[k], masks[k], **params)[0]
        for k in range(2)
    )
    torch.testing.assert_close(loss, expected)
    assert alpha[1].item() == pytest.approx(
        acceptance(drafts[1], per_depth[1])[masks[1]].mean().item()
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": 0.7}, "temperature 1, unfiltered"),
        ({"top_p": 0.9}, "temperature 1, unfiltered"),
        ({"top_k": 2}, "temperature 1, unfiltered"),
    ],
)
def test_rest_bin_refuses_what_it_cannot_know(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_loss("tv", logits_of(Q)[None], SPARSE, **kwargs)


def test_rest_bin_rejects_bad_fields():
    draft = logits_of(Q)[None]
    bad_shape = SparseTarget(SPARSE.indices, SPARSE.probs, torch.tensor([0.6, 0.1]))
    with pytest.raises(ValueError, match="must be"):
        compute_loss("tv", draft, bad_shape)
    negative = SparseTarget(SPARSE.indices, SPARSE.probs, torch.tensor([-0.1]))
    with pytest.raises(ValueError, match="finite, >= 0"):
        compute_loss("tv", draft, negative)
    outside = SparseTarget(torch.tensor([[2, 5]]), SPARSE.probs, SPARSE.rest)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        compute_loss("tv", draft, outside)
    # a masked position may hold anything
    loss, n = compute_loss("tv", draft, negative, torch.tensor([False]))
    assert loss.item() == 0.0 and n.item() == 0
