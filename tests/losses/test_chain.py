"""The accepted-length objective (losses/chain.py, losses/tau.py) on a tiny vocabulary, where
every chain can be enumerated: a Markov draft and target whose distribution at chain
position k depends on the previous token only."""

import itertools

import pytest
import torch

from specdistill.losses import compute_loss
from specdistill.losses.chain import (
    accepted_length,
    chain_weights,
    leave_one_out,
    row_terms,
    tau_objective,
    weighted_terms,
)
from specdistill.losses.tau import chunked_tau_loss, tau_loss

V, GAMMA = 3, 3


def tables(seed: int, scale: float = 1.5):
    """Draft and target logits [γ, V (previous token), V]; position 1's previous token is 0."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(GAMMA, V, V, generator=g, dtype=torch.float64) * scale
    target = torch.randn(GAMMA, V, V, generator=g, dtype=torch.float64) * scale
    return draft, target


def chain_logits(table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The logits of each chain's γ positions: tokens [N, γ−1] -> [N, γ, V]."""
    prev = torch.cat([torch.zeros_like(tokens[:, :1]), tokens], 1)  # [N, γ]
    return table[torch.arange(table.shape[0]), prev]


def all_chains() -> torch.Tensor:
    return torch.tensor(list(itertools.product(range(V), repeat=GAMMA - 1)))


def enumerated_objective(draft_table, target_table, temperature=1.0):
    """E_{a~q}[L(a)] by enumerating every chain: differentiable in the draft table."""
    tokens = all_chains()
    d = (chain_logits(draft_table, tokens) / temperature).log_softmax(-1)
    t = (chain_logits(target_table, tokens) / temperature).log_softmax(-1)
    terms = row_terms(d, t, tokens)
    chain_prob = terms.log_q.sum(-1).exp()
    return (chain_prob * accepted_length(terms.log_r, terms.log_alpha)).sum()


def expected_accepted_exact(draft_table, target_table) -> float:
    """Σ_k P(draft tokens 1..k all accepted), with P = Σ_{a≤k} Π_j min(p_j, q_j)(a_j): the
    speculative-sampling acceptance computed independently of losses/chain.py."""
    q, p = draft_table.softmax(-1), target_table.softmax(-1)
    total = 0.0
    for k in range(1, GAMMA + 1):
        for prefix in itertools.product(range(V), repeat=k):
            prob, prev = 1.0, 0
            for j, a in enumerate(prefix):
                prob *= float(torch.minimum(q[j, prev, a], p[j, prev, a]))
                prev = a
            total += prob
    return total


def sample_chains(draft_table, n: int, generator) -> torch.Tensor:
    tokens, prev = [], torch.zeros(n, dtype=torch.long)
    for k in range(GAMMA - 1):
        prev = torch.multinomial(draft_table[k, prev].softmax(-1), 1, generator=generator)[:, 0]
        tokens.append(prev)
    return torch.stack(tokens, 1)


@pytest.mark.parametrize("seed", [0, 1])
def test_expectation_is_the_exact_expected_accepted_length(seed):
    draft, target = tables(seed)
    exact = expected_accepted_exact(draft, target)
    assert float(enumerated_objective(draft, target)) == pytest.approx(exact, rel=1e-10)
    # The sampled estimate: within 4 standard errors of the exact value.
    g = torch.Generator().manual_seed(seed)
    tokens = sample_chains(draft, 20_000, g)
    d = chain_logits(draft, tokens).log_softmax(-1)
    t = chain_logits(target, tokens).log_softmax(-1)
    _, length = tau_objective(d, t, tokens)
    se = float(length.std()) / len(length) ** 0.5
    assert abs(float(length.mean()) - exact) < 4 * se


def test_product_of_alphas_is_not_the_expected_length():
    """Π_k α_k along the chain is not the acceptance of the chain (issue's warning)."""
    draft, target = tables(3)
    tokens = all_chains()
    d = chain_logits(draft, tokens).log_softmax(-1)
    t = chain_logits(target, tokens).log_softmax(-1)
    terms = row_terms(d, t, tokens)
    prob = terms.log_q.sum(-1).exp()
    alpha_products = terms.log_alpha.cumsum(-1).exp().sum(-1)
    wrong = float((prob * alpha_products).sum())
    assert abs(wrong - expected_accepted_exact(draft, target)) > 1e-3


def test_exact_form_passes_gradcheck():
    draft, target = tables(4)
    draft.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda table: enumerated_objective(table, target, temperature=0.8), (draft,)
    )


@pytest.mark.parametrize("estimator, group", [("score", None), ("score", 4)])
def test_sampled_gradient_agrees_with_the_exact_gradient(estimator, group):
    """The mean of the estimator's gradient over independent batches matches ∇(1 − J/γ)
    within 4 standard errors in every coordinate; also with the baseline taken within
    groups of `group` chains (several chains per prefix)."""
    groups = None if group is None else torch.arange(64) // group
    draft, target = tables(5, scale=1.0)
    table = draft.clone().requires_grad_(True)
    (exact,) = torch.autograd.grad(1.0 - enumerated_objective(table, target) / GAMMA, table)
    g = torch.Generator().manual_seed(0)
    grads = []
    for _ in range(300):
        tokens = sample_chains(draft, 64, g)
        d = chain_logits(table, tokens).log_softmax(-1)
        t = chain_logits(target, tokens).log_softmax(-1)
        loss, _ = tau_objective(d, t, tokens, estimator=estimator, groups=groups)
        (grad,) = torch.autograd.grad(loss.mean(), table)
        grads.append(grad)
    grads = torch.stack(grads)
    mean, se = grads.mean(0), grads.std(0) / len(grads) ** 0.5
    assert exact.abs().max() > 1e-3  # the check can fail
    assert ((mean - exact).abs() <= 4 * se + 1e-9).all(), (mean - exact) / (se + 1e-12)


def test_leave_one_out_within_groups():
    """Each chain's baseline is the mean G of the other valid chains of its group, or of the
    whole batch where its group has no other."""
    to_go = [1.0, 2.0, 4.0, 8.0, 0.0, 16.0]  # G_1 of each chain (c_2, with r_1 = 1)
    valid = torch.tensor([True, True, True, True, False, True])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    got = leave_one_out(torch.tensor(to_go)[:, None], valid, groups)[:, 0]
    assert got[:3].tolist() == [3.0, 2.5, 1.5]
    assert got[3].isnan() and got[5].isnan()  # no other valid chain in the group
    log_r = torch.zeros(6, 1)
    log_alpha = torch.log(torch.tensor([[0.5, g if g else 1.0] for g in to_go]))
    w = chain_weights(log_r, log_alpha, valid, groups=groups)
    assert w.q[:3, 0].tolist() == [1.0 - 3.0, 2.0 - 2.5, 4.0 - 1.5]
    assert float(w.q[3, 0]) == pytest.approx(8.0 - (1 + 2 + 4 + 16) / 4)  # the batch's
    assert float(w.q[5, 0]) == pytest.approx(16.0 - (1 + 2 + 4 + 8) / 4)
    assert float(w.q[4, 0]) == 0.0  # an invalid chain adds nothing


@pytest.mark.parametrize("seed", [6, 8])
def test_the_coefficient_baseline_lowers_the_gradient_variance(seed):
    """Where r_k < 1 the pathwise term of log r_k carries −G_k ∇log q_k(a_k), so a_k's score
    has the coefficient G_k·1[r_k = 1] − b_k in all: a baseline that estimates it (the
    default) gives a less noisy gradient than one that estimates G_k, at the same mean (the
    unbiasedness test above)."""
    draft, other = tables(seed, scale=1.0)
    table = draft.clone().requires_grad_(True)

    def grads(baseline):
        g, out = torch.Generator().manual_seed(1), []
        for _ in range(200):
            tokens = sample_chains(draft, 64, g)
            d = chain_logits(table, tokens).log_softmax(-1)
            t = chain_logits(draft + 0.3 * other, tokens).log_softmax(-1)
            terms = row_terms(d, t, tokens)
            weights = chain_weights(terms.log_r, terms.log_alpha, baseline=baseline)
            loss = -weighted_terms(terms, weights).mean() / GAMMA
            out.append(torch.autograd.grad(loss, table)[0])
        return torch.stack(out)

    reward, coefficient = grads("reward"), grads("coefficient")
    assert coefficient.var(0).sum() < 0.85 * reward.var(0).sum()
    mean_gap = (coefficient.mean(0) - reward.mean(0)).abs().max()
    assert mean_gap < 4 * float(reward.std(0).max()) / len(reward) ** 0.5


def test_pathwise_estimator_alone_is_biased():
    """Without the score-function term the gradient misses how the chain's own distribution
    moves with q (the documented bias of estimator=pathwise)."""
    draft, target = tables(5, scale=1.0)
    table = draft.clone().requires_grad_(True)
    (exact,) = torch.autograd.grad(1.0 - enumerated_objective(table, target) / GAMMA, table)
    tokens = all_chains()
    d = chain_logits(table, tokens).log_softmax(-1)
    t = chain_logits(target, tokens).log_softmax(-1)
    weight = row_terms(d, t, tokens).log_q.sum(-1).exp().detach()
    loss, _ = tau_objective(d, t, tokens, estimator="pathwise")
    (pathwise,) = torch.autograd.grad((weight * loss).sum(), table)
    assert (pathwise - exact).abs().max() > 1e-4


def test_gamma_one_is_the_per_token_alpha():
    g = torch.Generator().manual_seed(0)
    draft = torch.randn(6, 1, 11, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randn(6, 1, 11, generator=g, dtype=torch.float64)
    tokens = torch.zeros(6, 0, dtype=torch.long)
    loss_sum, n, length_sum, alpha_sum = tau_loss(draft, target, tokens, temperature=0.7)
    tv_sum, n_tv = compute_loss("tv", draft, target, temperature=0.7)
    assert int(n) == int(n_tv) == 6
    torch.testing.assert_close(loss_sum, tv_sum)
    torch.testing.assert_close(length_sum, 6 - tv_sum.detach())
    torch.testing.assert_close(alpha_sum, length_sum)
    grad_tau, grad_tv = torch.autograd.grad(loss_sum, draft), torch.autograd.grad(tv_sum, draft)
    torch.testing.assert_close(grad_tau, grad_tv)


@pytest.mark.parametrize("target_as_hidden", [False, True])
def test_chunked_equals_unchunked(target_as_hidden):
    g = torch.Generator().manual_seed(1)
    n, gamma, hidden, vocab = 5, 4, 6, 17
    d_hidden = torch.randn(n, gamma, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    d_head = torch.randn(vocab, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    t_hidden = torch.randn(n, gamma, hidden, generator=g, dtype=torch.float64)
    t_head = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    tokens = torch.randint(vocab, (n, gamma - 1), generator=g)
    mask = torch.tensor([True, True, False, True, True])
    t_logits = t_hidden @ t_head.T
    direct = tau_loss(d_hidden @ d_head.T, t_logits, tokens, mask, temperature=0.9, top_p=0.9)
    target = (t_hidden, t_head) if target_as_hidden else t_logits
    chunked = chunked_tau_loss(
        d_hidden, d_head, target, tokens, mask, chunk_size=3, temperature=0.9, top_p=0.9
    )
    for a, b in zip(direct, chunked, strict=True):
        torch.testing.assert_close(a, b)
    grads_direct = torch.autograd.grad(direct[0], (d_hidden, d_head))
    grads_chunked = torch.autograd.grad(chunked[0], (d_hidden, d_head))
    for a, b in zip(grads_direct, grads_chunked, strict=True):
        torch.testing.assert_close(a, b)


def test_masked_chains_add_nothing():
    g = torch.Generator().manual_seed(2)
    draft = torch.randn(4, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randn(4, 3, 7, generator=g, dtype=torch.float64)
    tokens = torch.randint(7, (4, 2), generator=g)
    mask = torch.tensor([True, False, True, False])
    loss, n, _, _ = tau_loss(draft, target, tokens, mask)
    kept = tau_loss(draft[mask], target[mask], tokens[mask])
    assert int(n) == 2
    torch.testing.assert_close(loss, kept[0])
    (grad,) = torch.autograd.grad(loss, draft)
    assert (grad[~mask] == 0).all()


def test_filtered_token_gives_a_finite_gradient():
    """A sampled token the target's top-p removed has r = 0: the chain stops there and the
    gradient stays finite."""
    draft = torch.zeros(2, 2, 4, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([4.0, 3.0, -5.0, -5.0], dtype=torch.float64).expand(2, 2, 4)
    tokens = torch.tensor([[3], [0]])
    loss, _, _, _ = tau_loss(draft, target, tokens, top_p=0.5)
    (grad,) = torch.autograd.grad(loss, draft)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="tokens must be"):
        tau_loss(torch.zeros(2, 3, 5), torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="not teacher-forced positions"):
        compute_loss("tau", torch.zeros(2, 5), torch.zeros(2, 5))
