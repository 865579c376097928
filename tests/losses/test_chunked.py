"""chunked_loss == compute_loss on the full logits, in values and gradients."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdistill.losses import LOSSES, SparseTarget, chunked_loss, compute_loss
from tests.losses.common import PARAMS

N, H, V = 23, 6, 9


def inputs(seed=0, n=N, hidden=H, vocab=V, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    draft_hidden = torch.randn(n, hidden, generator=generator, dtype=dtype, requires_grad=True)
    head = torch.randn(vocab, hidden, generator=generator, dtype=dtype, requires_grad=True)
    target = torch.randn(n, vocab, generator=generator, dtype=dtype) * 2
    mask = torch.rand(n, generator=generator) > 0.3
    return draft_hidden, head, target, mask


def direct_and_chunked(name, draft_hidden, head, target, mask, chunk_size=4, **kwargs):
    """((loss, n, grad_hidden, grad_head) direct, (same) chunked)."""
    kwargs = {**PARAMS.get(name, {}), **kwargs}
    results = []
    for chunked in (False, True):
        if chunked:
            loss, n = chunked_loss(
                name, draft_hidden, head, target, mask, chunk_size=chunk_size, **kwargs
            )
        else:
            if isinstance(target, tuple) and not isinstance(target, SparseTarget):
                dense_target = target[0] @ target[1].T
            else:
                dense_target = target
            loss, n = compute_loss(name, draft_hidden @ head.T, dense_target, mask, **kwargs)
        results.append((loss, n, *torch.autograd.grad(loss, (draft_hidden, head))))
    return results


def assert_same(direct, chunked):
    for a, b in zip(direct, chunked, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_chunked_equals_direct_for_every_loss(name):
    draft_hidden, head, target, mask = inputs()
    poisoned = target.clone()
    poisoned[~mask] = math.nan  # masked rows must not matter in either path
    assert_same(*direct_and_chunked(name, draft_hidden, head, poisoned, mask))
    assert_same(*direct_and_chunked(name, draft_hidden, head, target, None, chunk_size=N))
    assert_same(
        *direct_and_chunked(name, draft_hidden, head, target, mask, temperature=0.7, top_p=0.9)
    )


@pytest.mark.parametrize("name", ["fkl", "tv", "lk_lambda", "mix"])
def test_chunked_target_forms(name):
    draft_hidden, head, target, mask = inputs(1)
    generator = torch.Generator().manual_seed(1)
    target_hidden = torch.randn(N, 5, generator=generator, dtype=torch.float64)
    target_head = torch.randn(V + 4, 5, generator=generator, dtype=torch.float64)
    d2t = torch.tensor([0, 1, 1, 2, 4, 4, 4, 4, 4])  # draft tokens -> target ids in [0, V+4)
    # Target computed per chunk from its hidden states and head, over a larger vocabulary.
    target = (target_hidden, target_head)
    kwargs = {"d2t": d2t, "mask_out_of_vocab": True}
    assert_same(*direct_and_chunked(name, draft_hidden, head, target, mask, **kwargs))
    probs, indices = torch.rand(N, 3, generator=generator).double(), torch.arange(3).repeat(N, 1)
    assert_same(*direct_and_chunked(name, draft_hidden, head, SparseTarget(indices, probs), mask))


def test_chunked_batch_shape_and_lambda_token_mode():
    draft_hidden, head, target, mask = inputs(2, n=12)
    shaped = draft_hidden.detach().reshape(3, 4, H).requires_grad_()
    target, mask = target.reshape(3, 4, V), mask.reshape(3, 4)
    for kwargs in ({}, {"lambda_mode": "token", "eta": 5.0}):
        assert_same(*direct_and_chunked("lk_lambda", shaped, head, target, mask, 5, **kwargs))


def test_chunked_gradcheck_float64():
    draft_hidden, head, target, mask = inputs(3, n=7, hidden=3, vocab=5)
    for name, params in [("tv", {}), ("lk_lambda", {"alpha_bar": 0.3}), ("fkl", {})]:
        assert torch.autograd.gradcheck(
            lambda h, w, name=name, params=params: chunked_loss(
                name, h, w, target, mask, chunk_size=3, **params
            )[0],
            (draft_hidden, head),
            fast_mode=True,
        )


def test_chunked_no_grad_all_masked_and_half_precision():
    draft_hidden, head, target, mask = inputs(4)
    with torch.no_grad():
        loss, n = chunked_loss("tv", draft_hidden, head, target, mask, chunk_size=5)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, compute_loss("tv", draft_hidden @ head.T, target, mask)[0])
    # All masked: zero loss, zero (finite) gradients.
    results = direct_and_chunked(
        "lk_lambda", draft_hidden, head, target, torch.zeros(N, dtype=bool)
    )
    for loss, n, grad_hidden, grad_head in results:
        assert loss.item() == 0 and n.item() == 0
        assert not grad_hidden.any() and not grad_head.any()
    # bf16 hidden and head: fp32 loss, grads in the input dtype, close to direct.
    half = [x.detach().to(torch.bfloat16).requires_grad_() for x in (draft_hidden, head)]
    direct, chunked = direct_and_chunked("fkl", *half, target.float(), mask)
    assert chunked[0].dtype == torch.float32 and chunked[2].dtype == torch.bfloat16
    for a, b in zip(direct, chunked, strict=True):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_chunked_frozen_head_or_frozen_hidden():
    draft_hidden, head, target, mask = inputs(5)
    direct, _ = compute_loss("tv", draft_hidden @ head.T, target, mask)
    grads = torch.autograd.grad(direct, (draft_hidden, head))
    frozen_head, _ = chunked_loss("tv", draft_hidden, head.detach(), target, mask, chunk_size=4)
    (grad_hidden,) = torch.autograd.grad(frozen_head, draft_hidden)
    torch.testing.assert_close(grad_hidden, grads[0])
    frozen_hidden, _ = chunked_loss("tv", draft_hidden.detach(), head, target, mask, chunk_size=4)
    (grad_head,) = torch.autograd.grad(frozen_hidden, head)
    torch.testing.assert_close(grad_head, grads[1])


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(sorted(LOSSES)),
    n=st.integers(1, 30),
    vocab=st.integers(2, 16),
    chunk_size=st.integers(1, 12),
    temperature=st.floats(0.3, 3.0),
    seed=st.integers(0, 2**16),
)
def test_chunked_equals_direct_property(name, n, vocab, chunk_size, temperature, seed):
    draft_hidden, head, target, mask = inputs(seed, n=n, hidden=4, vocab=vocab)
    direct, chunked = direct_and_chunked(
        name, draft_hidden, head, target, mask, chunk_size, temperature=temperature
    )
    assert_same(direct, chunked)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_return_alpha_is_the_acceptance_of_the_full_logits(temperature):
    from specdistill.losses import acceptance

    draft_hidden, head, target, mask = inputs(seed=3)
    loss, n, alpha_sum = chunked_loss(
        "tv", draft_hidden, head, target, mask, chunk_size=5, temperature=temperature,
        return_alpha=True,
    )  # fmt: skip
    plain, _ = chunked_loss(
        "tv", draft_hidden, head, target, mask, chunk_size=5, temperature=temperature
    )
    expected = acceptance(draft_hidden @ head.T, target, temperature)[mask].sum()
    torch.testing.assert_close(alpha_sum, expected.detach())
    torch.testing.assert_close(loss, plain)
    assert not alpha_sum.requires_grad
