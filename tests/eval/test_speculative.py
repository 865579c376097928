"""Speculative decoding engine: greedy equality with the target, lossless sampling (chi-square),
cache rollback in batched mode, adaptive γ, and the acceptance metrics."""

import copy
import math

import pytest
import torch
from scipy import stats
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill.eval import speculative as spec
from specdistill.eval.offline import tau_pred


def tiny_llama(seed: int, *, vocab: int, hidden: int, layers: int, init: float) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=init,  # large enough that logits are far from ties
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


def perturbed(model: LlamaForCausalLM, scale: float, seed: int) -> LlamaForCausalLM:
    """A draft that agrees with `model` often but not always."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return draft


@torch.no_grad()
def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy decode, recomputed from scratch every step (no cache, no batch)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


N_NEW = 24


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0, vocab=96, hidden=64, layers=2, init=0.2)
    return target, perturbed(target, 0.015, seed=1)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 11, 6, 1, 8)]


@pytest.fixture(scope="module")
def references(pair, prompts):
    return [reference_greedy(pair[0], p, N_NEW) for p in prompts]


# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_greedy_equals_target_greedy(pair, prompts, references, gamma, batch_size):
    """Batch size 2 of 5 prompts admits prompts into a running batch (continuous batching)."""
    target, draft = pair
    out = spec.generate(
        target, draft, prompts, gamma=gamma, batch_size=batch_size, max_new_tokens=N_NEW
    )
    assert out.sequences == references
    assert max(len(r.requests) for r in out.rounds) == batch_size
    if batch_size == 1:  # requests wait for their turn
        assert out.queue_s == sorted(out.queue_s) and out.queue_s[0] < out.queue_s[1]
    assert all(0 < t <= total for t, total in zip(out.ttft_s, out.latency_s, strict=True))
    accepted = [n for r in out.rounds for n in r.accepted]
    # The draft must be accepted sometimes and rejected sometimes, or rollback is not exercised.
    assert 0 < sum(n == gamma for n in accepted) < len(accepted)
    if gamma > 1:
        assert any(0 < n < gamma for n in accepted)


@pytest.mark.parametrize("compact_fraction", [0.0, 1.0])
def test_greedy_batched_with_and_without_compaction(
    pair, prompts, references, compact_fraction, monkeypatch
):
    """Masked holes (never compact) and right-aligning gathers (always compact): same text."""
    monkeypatch.setattr(spec, "_COMPACT_FRACTION", compact_fraction)
    out = spec.generate(*pair, prompts, gamma=4, max_new_tokens=N_NEW)
    assert out.sequences == references


def test_greedy_adaptive_and_target_only(pair, prompts, references):
    target, draft = pair
    policy = spec.AdaptiveGamma(start=2, min_gamma=1, max_gamma=6)
    out = spec.generate(target, draft, prompts, gamma=policy, max_new_tokens=N_NEW)
    assert out.sequences == references
    assert len({r.gamma for r in out.rounds if not r.capped}) > 1  # the policy moved γ
    assert all(1 <= r.gamma <= 6 for r in out.rounds if not r.capped)
    baseline = spec.generate(
        target,
        None,
        torch.tensor([[0, 0, *prompts[1][:3]]]),
        max_new_tokens=N_NEW,
        attention_mask=torch.tensor([[0, 0, 1, 1, 1]]),
    )
    assert baseline.sequences == [reference_greedy(target, prompts[1][:3], N_NEW)]
    assert all(r.gamma == 0 and r.committed == [1] for r in baseline.rounds)


def test_greedy_pathwise_tau_matches_measured(pair, prompts):
    """At T=0 offline α is argmax agreement along the target's greedy text, so the pathwise
    prediction must reproduce every round's accepted length."""
    target, draft = pair
    out = spec.generate(target, draft, prompts, gamma=4, batch_size=1, max_new_tokens=N_NEW)
    alphas = [
        spec.positional_alpha(target, draft, p, o, temperature=0.0)
        for p, o in zip(prompts, out.sequences, strict=True)
    ]
    measured = spec.acceptance_stats(out.rounds)["tau"]
    assert spec.pathwise_tau(out.rounds, alphas) == pytest.approx(measured, abs=1e-12)


def test_eos_and_length_limits(pair, prompts, references):
    target, draft = pair
    eos = references[1][7]
    cut = references[1][: references[1].index(eos) + 1]
    for d in (draft, None):
        out = spec.generate(
            target, d, [prompts[1]], gamma=3, max_new_tokens=N_NEW, eos_token_id=eos
        )
        assert out.sequences == [cut]
    out = spec.generate(target, draft, prompts, gamma=6, max_new_tokens=5)
    assert out.sequences == [r[:5] for r in references]
    assert all(r.gamma <= 4 for r in out.rounds)  # never drafts past the last needed token


# ----------------------------------------------------------------------------- sampling

V_SMALL = 8
N_SAMPLES = 20_000
PREFIX = [1, 5, 2]


@pytest.fixture(scope="module")
def small_pair():
    target = tiny_llama(0, vocab=V_SMALL, hidden=32, layers=1, init=0.2)
    return target, perturbed(target, 0.04, seed=1)


@torch.no_grad()
def joint_first_two(target, temperature, top_p, top_k) -> torch.Tensor:
    """Exact target distribution of the first two generated tokens: [V*V] float64."""
    p1 = spec.probabilities(
        target(input_ids=torch.tensor([PREFIX])).logits[0, -1], temperature, top_p, top_k
    )
    ids = torch.tensor([PREFIX + [x] for x in range(V_SMALL)])
    p2 = spec.probabilities(target(input_ids=ids).logits[:, -1], temperature, top_p, top_k)
    return (p1[:, None] * p2).flatten().double()


def chi_square_pvalue(samples: list[list[int]], probs: torch.Tensor) -> float:
    """Goodness of fit of (x1, x2) pairs to `probs`; cells expecting < 5 are pooled."""
    first_two = torch.tensor([s[:2] for s in samples])
    counts = torch.bincount(
        first_two[:, 0] * V_SMALL + first_two[:, 1], minlength=V_SMALL**2
    ).double()
    assert counts[probs == 0].sum() == 0, "a token outside the target's support was emitted"
    counts, expected = counts[probs > 0], probs[probs > 0] * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    observed = counts
    statistic = float(((observed - expected) ** 2 / expected).sum())
    return float(stats.chi2.sf(statistic, observed.numel() - 1))


def sample_pairs(small_pair, gamma, temperature=1.0, top_p=1.0, top_k=0, seed=0, batch_size=None):
    # γ + 1 new tokens so the first round is not shortened by the length limit.
    return spec.generate(
        *small_pair,
        [PREFIX] * N_SAMPLES,
        gamma=gamma,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=gamma + 1,
        seed=seed,
        batch_size=batch_size,
    )


@pytest.mark.parametrize(
    "gamma, temperature, top_p, top_k, batch_size",
    [
        (1, 1.0, 1.0, 0, None),
        (2, 1.0, 1.0, 0, None),
        (3, 0.8, 0.9, 6, None),
        (2, 1.0, 1.0, 0, 6000),
    ],
)
def test_sampling_is_lossless(small_pair, gamma, temperature, top_p, top_k, batch_size):
    out = sample_pairs(small_pair, gamma, temperature, top_p, top_k, batch_size=batch_size)
    first = [n for r in out.rounds for n, s in zip(r.accepted, r.starts, strict=True) if s == 0]
    # Both paths are exercised: rejections (residual) and full acceptance (bonus token).
    assert 0.1 < sum(n < gamma for n in first) / len(first) < 0.9
    assert (
        chi_square_pvalue(out.sequences, joint_first_two(small_pair[0], temperature, top_p, top_k))
        > 1e-3
    )


def test_chi_square_catches_a_wrong_residual(small_pair, monkeypatch):
    """Resampling from p instead of the residual after a rejection over-weights draft tokens."""
    monkeypatch.setattr(spec, "_residual", lambda p, q: p)
    out = sample_pairs(small_pair, gamma=2)
    assert chi_square_pvalue(out.sequences, joint_first_two(small_pair[0], 1.0, 1.0, 0)) < 1e-6


def test_chi_square_catches_a_wrong_bonus(small_pair, monkeypatch):
    """A bonus token drawn from p_γ (off by one) instead of p_{γ+1}."""
    real = spec.verify_sampled

    def off_by_one_bonus(p, q, drafts, generator):
        p = p.clone()
        p[:, -1] = p[:, -2]
        return real(p, q, drafts, generator)

    monkeypatch.setattr(spec, "verify_sampled", off_by_one_bonus)
    out = sample_pairs(small_pair, gamma=1)
    assert chi_square_pvalue(out.sequences, joint_first_two(small_pair[0], 1.0, 1.0, 0)) < 1e-6


def test_sampling_is_reproducible_and_seeded(small_pair):
    a = spec.generate(
        *small_pair, [PREFIX] * 4, gamma=2, temperature=1.0, max_new_tokens=12, seed=7
    )
    b = spec.generate(
        *small_pair, [PREFIX] * 4, gamma=2, temperature=1.0, max_new_tokens=12, seed=7
    )
    c = spec.generate(
        *small_pair, [PREFIX] * 4, gamma=2, temperature=1.0, max_new_tokens=12, seed=8
    )
    assert a.sequences == b.sequences != c.sequences


# ----------------------------------------------------------------------------- pieces


def test_verify_sampled_extremes():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]]])
    drafts = torch.tensor([[0, 2]])
    # q == p on the drafted slots: always accepted, then the bonus comes from p_3.
    n, nxt = spec.verify_sampled(p, p[:, :2], drafts, g)
    assert n.tolist() == [2] and nxt.tolist() == [1]
    # The draft puts all mass where the target has none: rejected at slot 1, residual = p_1.
    q = torch.tensor([[[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]])
    for _ in range(20):
        n, nxt = spec.verify_sampled(p, q, torch.tensor([[2, 2]]), g)
        assert n.tolist() == [0] and nxt.item() in (0, 1)
    # Residual: max(0, p − q) renormalised.
    r = spec._residual(torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([[0.2, 0.5, 0.3]]))
    assert torch.allclose(r, torch.tensor([[1.0, 0.0, 0.0]]))


def test_verify_greedy():
    logits = torch.tensor([[[0.0, 9.0, 0.0], [9.0, 0.0, 0.0], [0.0, 0.0, 9.0]]]).repeat(2, 1, 1)
    n, nxt = spec.verify_greedy(logits, torch.tensor([[1, 0], [1, 2]]))
    assert n.tolist() == [2, 1] and nxt.tolist() == [2, 0]


def test_probabilities_filters():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(spec.probabilities(logits, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(
        spec.probabilities(logits, 1.0, top_p=0.8), torch.tensor([0.625, 0.375, 0, 0])
    )
    assert torch.allclose(
        spec.probabilities(logits, 1.0, top_p=0.81), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95
    )
    assert torch.allclose(spec.probabilities(logits, 1.0, top_k=1), torch.tensor([1.0, 0, 0, 0]))
    sharp = spec.probabilities(logits, 0.5)
    assert torch.allclose(sharp, torch.tensor([0.25, 0.09, 0.0225, 0.0025]) / 0.365)


def _round(gamma, accepted, capped=False):
    k = len(accepted)
    return spec.Round(gamma, capped, list(range(k)), [1] * k, accepted, [1] * k, 0.0, 0.0, 0.0)


def test_acceptance_stats_counts_runs_per_round():
    rounds = [_round(3, [0, 3]), _round(3, [1, 2]), _round(3, [3]), _round(3, [0], capped=True)]
    s = spec.acceptance_stats(rounds)
    assert s["tau"] == pytest.approx((1 + 4 + 2 + 3 + 4) / 5)
    assert s["slot_acceptance"] == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert s["rejection_histogram"] == [1, 1, 1] and s["no_rejection"] == 2
    assert s["tau_from_slots"] == pytest.approx(s["tau"])
    assert s["acceptance_rate"] == pytest.approx(9 / 12)


def test_alpha_for_tau_and_speedup_model():
    assert spec.alpha_for_tau(tau_pred(0.7, 4), 4) == pytest.approx(0.7, abs=1e-9)
    assert spec.speedup_model(0.8, 4, 0.0) == pytest.approx(tau_pred(0.8, 4))
    assert spec.speedup_model(0.8, 4, 0.1) == pytest.approx(tau_pred(0.8, 4) / 1.4)
    assert spec.best_gamma_model(0.9, 0.01) > spec.best_gamma_model(0.5, 0.01) >= 1
    assert spec.best_gamma_model(0.5, 1.0) == 1


def test_adaptive_gamma_policy():
    policy = spec.AdaptiveGamma(start=3, min_gamma=2, max_gamma=6)
    policy.update([3, 3], 3)
    assert policy.gamma == 5
    policy.update([5], 5)
    assert policy.gamma == 6  # bounded above
    policy.update([0, 1], 6)
    policy.update([0, 1], 5)
    policy.update([0, 1], 4)
    policy.update([0, 0], 3)
    assert policy.gamma == 2  # bounded below
    policy.update([1, 2], 2)  # mean fraction 0.75: unchanged
    assert policy.gamma == 2
    with pytest.raises(ValueError, match="min_gamma"):
        spec.AdaptiveGamma(start=1, min_gamma=2, max_gamma=4)


def test_quick_eval(pair, prompts):
    target, draft = pair
    draft.train()  # as the trainer would call it
    try:
        result = spec.quick_eval(target, draft, prompts[:2], gammas=(1, 3), max_new_tokens=8)
        assert draft.training and not target.training  # modes restored
    finally:
        draft.eval()
    assert result["best_gamma"] in (1, 3)
    assert set(result["tau"]) == {1, 3} and all(1.0 <= t <= g + 1 for g, t in result["tau"].items())
    assert result["speedup"][result["best_gamma"]] == result["best_speedup"] > 0


def test_rejects_bad_arguments(pair, prompts):
    with pytest.raises(ValueError, match="gamma must be"):
        spec.generate(*pair, prompts, gamma=0)
    with pytest.raises(ValueError, match="top_p"):
        spec.generate(*pair, prompts, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="at least one token"):
        spec.generate(*pair, [[]])
    assert math.isnan(spec.percentiles([math.nan])["p50"])
