"""`VocabTarget`: the target's log-probabilities stored over the draft's own columns give every
loss, α and gradient the live target gives a draft over a reduced vocabulary (with d2t), and
refuse what they cannot know."""

import pytest
import torch

from specdistill.losses import VocabTarget, acceptance, acceptance_label, compute_loss
from specdistill.losses.multi_depth import multi_depth_loss
from tests.losses.common import PARAMS

LOSSES = ["fkl", "rkl", "jsd", "tv", "lk_alpha", "lk_lambda", "ce", "topk_ce", "mix"]


def _pair(seed: int = 0, vocab: int = 13, k: int = 6, shape=(3, 5)):
    """(draft logits over K columns, live target logits over V, d2t, the stored VocabTarget,
    mask with a masked position)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=g)[:k].sort().values
    d2t = ids - torch.arange(k)
    draft = torch.randn(*shape, k, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * 2
    stored = VocabTarget(target.log_softmax(-1)[..., ids])
    mask = torch.ones(shape, dtype=torch.bool)
    mask[0, 1] = False
    return draft, target, d2t, stored, mask


@pytest.mark.parametrize("name", LOSSES)
def test_losses_and_gradients_equal_the_live_target_with_d2t(name):
    draft, target, d2t, stored, mask = _pair()
    params = PARAMS.get(name, {})
    live, n_live = compute_loss(name, draft, target, mask, d2t=d2t, **params)
    cached, n_cached = compute_loss(name, draft, stored, mask, **params)
    torch.testing.assert_close(cached, live, rtol=1e-9, atol=1e-9)
    assert n_cached == n_live
    (g_live,) = torch.autograd.grad(live, draft)
    (g_cached,) = torch.autograd.grad(cached, draft)
    torch.testing.assert_close(g_cached, g_live, rtol=1e-9, atol=1e-9)


def test_alpha_labels_and_depths_equal_the_live_target():
    draft, target, d2t, stored, mask = _pair(seed=1)
    torch.testing.assert_close(
        acceptance(draft, stored, 1.0, mask), acceptance(draft, target, 1.0, mask, d2t=d2t)
    )
    torch.testing.assert_close(
        acceptance_label(draft, stored, mask), acceptance_label(draft, target, mask, d2t=d2t)
    )
    loss, n, alpha = multi_depth_loss("tv", [draft, draft * 0.5], [stored, stored], [mask, mask])
    live = multi_depth_loss("tv", [draft, draft * 0.5], [target, target], [mask, mask], d2t=d2t)
    torch.testing.assert_close(loss, live[0])
    torch.testing.assert_close(alpha, live[2])


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": 0.7}, {"top_p": 0.9}, {"top_k": 2}, {"mask_out_of_vocab": True}],
)
def test_what_the_stored_columns_cannot_know_is_refused(kwargs):
    draft, _, d2t, stored, mask = _pair()
    if kwargs.get("mask_out_of_vocab"):
        kwargs = {**kwargs, "d2t": d2t}
    with pytest.raises(ValueError, match="VocabTarget"):
        compute_loss("tv", draft, stored, mask, **kwargs)
    with pytest.raises(ValueError, match="VocabTarget"):
        acceptance(draft, stored, 0.0, mask)


def test_bad_stored_values_are_named():
    draft, _, _, stored, mask = _pair()
    nan = stored.logp.clone()
    nan[1, 2, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN, above 0 or carry no mass"):
        compute_loss("tv", draft, VocabTarget(nan), mask)
    with pytest.raises(ValueError, match="must equal draft_logits shape"):
        compute_loss("tv", draft, VocabTarget(stored.logp[..., :-1]), mask)
    # a masked position may hold anything
    junk = stored.logp.clone()
    junk[0, 1] = float("nan")
    assert torch.isfinite(compute_loss("tv", draft, VocabTarget(junk), mask)[0])
