"""Speculative decoding engine: greedy equality with the target, lossless sampling (chi-square),
cache rollback in batched mode, adaptive γ, and the acceptance metrics."""

import math

import pytest
import torch

from specdistill import losses
from specdistill.eval import engine, verify
from specdistill.eval import sampling as engine_sampling
from specdistill.eval import stats as metrics
from specdistill.eval.stats import tau_iid
from specdistill.eval.sweep import Settings, sweep
from specdistill.losses import sampling
from specdistill.models import kv_cache as cache
from tests.eval.helpers import (
    N_NEW,
    PREFIX,
    V_SMALL,
    chi_square_pvalue,
    joint_first_two,
    perturbed,
    reference_greedy,
    sample_pairs,
    tiny_llama,
)

# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_greedy_equals_target_greedy(perturbed_pair, prompts, references, gamma, batch_size):
    """Batch size 2 of 5 prompts admits prompts into a running batch (continuous batching)."""
    target, draft = perturbed_pair
    out = engine.generate(
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
    perturbed_pair, prompts, references, compact_fraction, monkeypatch
):
    """Masked holes (never compact) and right-aligning gathers (always compact): same text."""
    monkeypatch.setattr(cache, "_COMPACT_FRACTION", compact_fraction)
    out = engine.generate(*perturbed_pair, prompts, gamma=4, max_new_tokens=N_NEW)
    assert out.sequences == references


def test_greedy_when_cache_buffers_fill_up(perturbed_pair, prompts, references, monkeypatch):
    """One spare position per growth: the cache layers copy into new buffers almost every
    append, and appends after rollbacks overwrite rejected positions in place."""
    monkeypatch.setattr(cache, "_MIN_SPARE", 1)
    out = engine.generate(*perturbed_pair, prompts, gamma=3, batch_size=2, max_new_tokens=N_NEW)
    assert out.sequences == references


def test_growing_layer_appends_in_place_and_follows_replaced_tensors(monkeypatch):
    monkeypatch.setattr(cache, "_MIN_SPARE", 4)
    g = torch.Generator().manual_seed(0)

    layer, expect = cache.GrowingLayer(), torch.zeros(2, 3, 0, 8)

    def append(n):
        nonlocal expect
        new = torch.randn(expect.shape[0], 3, n, 8, generator=g)
        expect = torch.cat([expect, new], dim=2)
        keys, values = layer.update(new, -new)
        assert torch.equal(keys, expect) and torch.equal(values, -expect)
        return keys.data_ptr()

    first = append(5)  # buffer of 5 + 4 spare
    assert append(2) == first  # fits: written in place
    rollback = slice(0, 4)
    layer.keys, layer.values = layer.keys[:, :, rollback], layer.values[:, :, rollback]
    expect = expect[:, :, rollback]
    assert append(3) == first  # a rolled-back tail is overwritten in place
    assert append(3) != first  # 10 > 9: a new, larger buffer
    for change in (lambda t: t[:, :, 2:], lambda t: t.flip(2).contiguous(), lambda t: t[:1]):
        # a front slice, a gather, a row selection: copied into a new buffer
        layer.keys, layer.values, expect = change(layer.keys), change(layer.values), change(expect)
        append(1)


def test_additive_mask():
    mask = torch.tensor([[False, True, True, True, False, True], [True] * 6])
    out = cache.additive_mask(mask, 3, torch.float32)
    assert out.shape == (2, 1, 3, 6)
    allowed = out[:, 0] == 0
    assert allowed[0].tolist() == [
        [False, True, True, True, False, False],
        [False, True, True, True, True, False],  # the padding query sees itself only among new
        [False, True, True, True, False, True],
    ]
    assert allowed[1].tolist() == [[True] * 4 + [False] * 2, [True] * 5 + [False], [True] * 6]
    assert out[~(out == 0)].eq(torch.finfo(torch.float32).min).all()


@torch.no_grad()
def test_stream_logits_match_a_plain_dynamic_cache(perturbed_pair):
    """The growing cache layers and the prepared 4-D mask change no logits: the same chunks,
    with padding and a rolled-back tail, through a stream and through a stock DynamicCache with
    transformers' own masks (both with transformers' forward; tests/eval/test_lean.py compares
    the lean forward)."""
    from transformers import DynamicCache

    target = perturbed_pair[0]
    fast = cache.KVStream(target, 96, torch.device("cpu"), lean=False)
    plain = cache.KVStream(target, 96, torch.device("cpu"), lean=False)
    plain.cache, plain.additive = DynamicCache(config=target.config), False
    assert fast.additive and isinstance(fast.cache.layers[0], cache.GrowingLayer)
    for s in (fast, plain):
        s.admit([[5, 6, 7], [8]])
    g = torch.Generator().manual_seed(0)
    for k, valid_first in [(4, True), (1, True), (3, False), (5, True)]:
        tokens = torch.randint(0, 96, (2, k), generator=g)
        valid = torch.ones(2, k, dtype=torch.bool)
        valid[1, 0] = valid_first
        a = fast.forward(tokens, valid, keep=k)
        b = plain.forward(tokens, valid, keep=k)
        torch.testing.assert_close(a[valid], b[valid], rtol=1e-5, atol=1e-5)
        for s in (fast, plain):
            s.drop_last(torch.tensor([k - 1, 0]))


def test_greedy_adaptive_and_target_only(perturbed_pair, prompts, references):
    target, draft = perturbed_pair
    policy = engine.AdaptiveGamma(start=2, min_gamma=1, max_gamma=6)
    out = engine.generate(target, draft, prompts, gamma=policy, max_new_tokens=N_NEW)
    assert out.sequences == references
    assert len({r.gamma for r in out.rounds if not r.capped}) > 1  # the policy moved γ
    assert all(1 <= r.gamma <= 6 for r in out.rounds if not r.capped)
    baseline = engine.generate(
        target,
        None,
        torch.tensor([[0, 0, *prompts[1][:3]]]),
        max_new_tokens=N_NEW,
        attention_mask=torch.tensor([[0, 0, 1, 1, 1]]),
    )
    assert baseline.sequences == [reference_greedy(target, prompts[1][:3], N_NEW)]
    assert all(r.gamma == 0 and r.committed == [1] for r in baseline.rounds)


def test_greedy_pathwise_tau_matches_measured(perturbed_pair, prompts):
    """At T=0 offline α is argmax agreement along the target's greedy text, so the pathwise
    prediction must reproduce every round's accepted length."""
    target, draft = perturbed_pair
    out = engine.generate(target, draft, prompts, gamma=4, batch_size=1, max_new_tokens=N_NEW)
    alphas = [
        metrics.positional_alpha(target, draft, p, o, temperature=0.0)
        for p, o in zip(prompts, out.sequences, strict=True)
    ]
    measured = metrics.acceptance_stats(out.rounds)["tau"]
    assert metrics.pathwise_tau(out.rounds, alphas) == pytest.approx(measured, abs=1e-12)


def test_eos_and_length_limits(perturbed_pair, prompts, references):
    target, draft = perturbed_pair
    eos = references[1][7]
    cut = references[1][: references[1].index(eos) + 1]
    for d in (draft, None):
        out = engine.generate(
            target, d, [prompts[1]], gamma=3, max_new_tokens=N_NEW, eos_token_id=eos
        )
        assert out.sequences == [cut]
    out = engine.generate(target, draft, prompts, gamma=6, max_new_tokens=5)
    assert out.sequences == [r[:5] for r in references]
    assert all(r.gamma <= 4 for r in out.rounds)  # never drafts past the last needed token


# ----------------------------------------------------------------------------- sampling


@pytest.mark.parametrize(
    "gamma, temperature, top_p, top_k, batch_size",
    [
        (1, 1.0, None, None, None),
        (2, 1.0, None, None, None),
        (3, 0.8, 0.9, 6, None),
        (2, 1.0, None, None, 6000),
    ],
)
def test_sampling_is_lossless(small_perturbed_pair, gamma, temperature, top_p, top_k, batch_size):
    out = sample_pairs(
        small_perturbed_pair, gamma, temperature, top_p, top_k, batch_size=batch_size
    )
    first = [n for r in out.rounds for n, s in zip(r.accepted, r.starts, strict=True) if s == 0]
    # Both paths are exercised: rejections (residual) and full acceptance (bonus token).
    assert 0.1 < sum(n < gamma for n in first) / len(first) < 0.9
    assert (
        chi_square_pvalue(
            out.sequences, joint_first_two(small_perturbed_pair[0], temperature, top_p, top_k)
        )
        > 1e-3
    )


def test_chi_square_catches_a_wrong_residual(small_perturbed_pair, monkeypatch):
    """Resampling from p instead of the residual after a rejection over-weights draft tokens."""
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    out = sample_pairs(small_perturbed_pair, gamma=2)
    assert (
        chi_square_pvalue(out.sequences, joint_first_two(small_perturbed_pair[0], 1.0, None, None))
        < 1e-6
    )


def test_chi_square_catches_a_wrong_bonus(small_perturbed_pair, monkeypatch):
    """A bonus token drawn from p_γ (off by one) instead of p_{γ+1}."""
    real = verify.verify_sampled

    def off_by_one_bonus(p, q, drafts, generator):
        p = p.clone()
        p[:, -1] = p[:, -2]
        return real(p, q, drafts, generator)

    monkeypatch.setattr(verify, "verify_sampled", off_by_one_bonus)
    out = sample_pairs(small_perturbed_pair, gamma=1)
    assert (
        chi_square_pvalue(out.sequences, joint_first_two(small_perturbed_pair[0], 1.0, None, None))
        < 1e-6
    )


def test_sampling_is_reproducible_and_seeded(small_perturbed_pair):
    a = engine.generate(
        *small_perturbed_pair, [PREFIX] * 4, gamma=2, temperature=1.0, max_new_tokens=12, seed=7
    )
    b = engine.generate(
        *small_perturbed_pair, [PREFIX] * 4, gamma=2, temperature=1.0, max_new_tokens=12, seed=7
    )
    c = engine.generate(
        *small_perturbed_pair, [PREFIX] * 4, gamma=2, temperature=1.0, max_new_tokens=12, seed=8
    )
    assert a.sequences == b.sequences != c.sequences


# ----------------------------------------------------------------------------- top-p: α

TOP_P = 0.7


@pytest.fixture(scope="module")
def close_pair():
    """A draft close to its target, so that filtering q too would change α a lot: a filtered
    q is nearly the filtered p (α ≈ 1), the unfiltered q keeps about 1 − top_p of its mass
    outside p's nucleus."""
    target = tiny_llama(0, vocab=V_SMALL, hidden=32, layers=1, init=0.2)
    return target, perturbed(target, 0.01, seed=1)


@torch.no_grad()
def filtered_q_alpha(target, draft, prompt: list[int], output: list[int]) -> list[float]:
    """Offline α along the text as if the draft sampled from q filtered like p."""
    ids, keep = torch.tensor([prompt + output]), len(output) + 1
    t_logits = target(input_ids=ids, logits_to_keep=keep).logits[0]
    d_logits = draft(input_ids=ids, logits_to_keep=keep).logits[0]
    d_logits = sampling.filter_logits(d_logits, 1.0, TOP_P)
    return losses.acceptance(d_logits, t_logits, 1.0, top_p=TOP_P).tolist()


def top_p_runs(target, draft) -> list[tuple]:
    """Engine runs at γ = 1, T = 1, top_p = TOP_P (40 prompts × 2 seeds), each with the
    offline α along its own text: [(rounds, α with the unfiltered q, α with a filtered q)]."""
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 9, (40,), generator=g).tolist()
    prompts = [torch.randint(0, V_SMALL, (n,), generator=g).tolist() for n in lengths]
    runs = []
    for seed in (0, 1):
        out = engine.generate(
            target,
            draft,
            prompts,
            gamma=1,
            temperature=1.0,
            top_p=TOP_P,
            max_new_tokens=24,
            seed=seed,
        )
        pairs = list(zip(prompts, out.sequences, strict=True))
        alphas = [
            metrics.positional_alpha(target, draft, p, o, temperature=1.0, top_p=TOP_P)
            for p, o in pairs
        ]
        runs.append((out.rounds, alphas, [filtered_q_alpha(target, draft, p, o) for p, o in pairs]))
    return runs


def pathwise_agreement(runs, which: int) -> tuple[float, float, float]:
    """(measured τ, pathwise τ from the α at runs[i][which], tolerance) over all the runs.

    With γ = 1 a round's draft is accepted with probability α_s given the text so far (α at
    its start s), so measured − predicted is a mean of N martingale differences of variance
    α_s(1 − α_s): the tolerance is 4 standard errors, sqrt(Σ α_s(1 − α_s)) / N.
    """
    measured = predicted = variance = 0.0
    n_total = 0
    for run in runs:
        rounds, alphas = run[0], run[which]
        starts = [
            (request, s)
            for r in rounds
            if r.gamma > 0 and not r.capped
            for request, s in zip(r.requests, r.starts, strict=True)
        ]
        n = len(starts)
        measured += metrics.acceptance_stats(rounds)["tau"] * n
        predicted += metrics.pathwise_tau(rounds, alphas) * n
        variance += sum(alphas[r][s] * (1 - alphas[r][s]) for r, s in starts)
        n_total += n
    return measured / n_total, predicted / n_total, 4 * math.sqrt(variance) / n_total


def test_offline_alpha_predicts_measured_acceptance_under_top_p(close_pair, monkeypatch):
    """docs/theory.md §1: the draft is not filtered, so under top-p the engine accepts at the
    offline α = losses.acceptance(draft, target, T, top_p) = Σ min(p_filtered, q)."""
    runs = top_p_runs(*close_pair)
    measured, predicted, tolerance = pathwise_agreement(runs, 1)
    assert abs(measured - predicted) <= tolerance
    # The α of a filtered q is told apart: it lies well outside the tolerance.
    _, wrong, _ = pathwise_agreement(runs, 2)
    assert abs(measured - wrong) > 2 * tolerance
    # And an engine that drafted from a filtered q (lossless too) fails the prediction.
    monkeypatch.setattr(engine_sampling.Sampler, "q", engine_sampling.Sampler.p)
    runs = top_p_runs(*close_pair)
    measured, predicted, tolerance = pathwise_agreement(runs, 1)
    assert abs(measured - predicted) > 2 * tolerance
    measured, predicted, tolerance = pathwise_agreement(runs, 2)
    assert abs(measured - predicted) <= tolerance


# ----------------------------------------------------------------------------- pieces


def test_verify_sampled_extremes():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]]])
    drafts = torch.tensor([[0, 2]])
    # q == p on the drafted slots: always accepted, then the bonus comes from p_3.
    n, nxt = verify.verify_sampled(p, p[:, :2], drafts, g)
    assert n.tolist() == [2] and nxt.tolist() == [1]
    # The draft puts all mass where the target has none: rejected at slot 1, residual = p_1.
    q = torch.tensor([[[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]])
    for _ in range(20):
        n, nxt = verify.verify_sampled(p, q, torch.tensor([[2, 2]]), g)
        assert n.tolist() == [0] and nxt.item() in (0, 1)
    # Residual: max(0, p − q) renormalised.
    r = verify.residual(torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([[0.2, 0.5, 0.3]]))
    assert torch.allclose(r, torch.tensor([[1.0, 0.0, 0.0]]))


def test_verify_greedy():
    logits = torch.tensor([[[0.0, 9.0, 0.0], [9.0, 0.0, 0.0], [0.0, 0.0, 9.0]]]).repeat(2, 1, 1)
    n, nxt = verify.verify_greedy(logits, torch.tensor([[1, 0], [1, 2]]))
    assert n.tolist() == [2, 1] and nxt.tolist() == [2, 0]


def test_probabilities_filters():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(sampling.probabilities(logits, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(
        sampling.probabilities(logits, 1.0, top_p=0.8), torch.tensor([0.625, 0.375, 0, 0])
    )
    assert torch.allclose(
        sampling.probabilities(logits, 1.0, top_p=0.81), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95
    )
    assert torch.allclose(
        sampling.probabilities(logits, 1.0, top_k=1), torch.tensor([1.0, 0, 0, 0])
    )
    sharp = sampling.probabilities(logits, 0.5)
    assert torch.allclose(sharp, torch.tensor([0.25, 0.09, 0.0225, 0.0025]) / 0.365)


def _round(gamma, accepted, capped=False):
    k = len(accepted)
    return engine.Round(gamma, capped, list(range(k)), [1] * k, accepted, [1] * k, 0.0, 0.0, 0.0)


def test_acceptance_stats_counts_runs_per_round():
    rounds = [_round(3, [0, 3]), _round(3, [1, 2]), _round(3, [3]), _round(3, [0], capped=True)]
    s = metrics.acceptance_stats(rounds)
    assert s["tau"] == pytest.approx((1 + 4 + 2 + 3 + 4) / 5)
    assert s["slot_acceptance"] == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert s["rejection_histogram"] == [1, 1, 1] and s["no_rejection"] == 2
    assert s["tau_from_slots"] == pytest.approx(s["tau"])
    assert s["acceptance_rate"] == pytest.approx(9 / 12)


def test_alpha_for_tau_and_speedup_model():
    assert metrics.alpha_for_tau(tau_iid(0.7, 4), 4) == pytest.approx(0.7, abs=1e-9)
    assert metrics.speedup_model(0.8, 4, 0.0) == pytest.approx(tau_iid(0.8, 4))
    assert metrics.speedup_model(0.8, 4, 0.1) == pytest.approx(tau_iid(0.8, 4) / 1.4)
    assert metrics.best_gamma_model(0.9, 0.01) > metrics.best_gamma_model(0.5, 0.01) >= 1
    assert metrics.best_gamma_model(0.5, 1.0) == 1


def test_adaptive_gamma_policy():
    policy = engine.AdaptiveGamma(start=3, min_gamma=2, max_gamma=6)
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
        engine.AdaptiveGamma(start=1, min_gamma=2, max_gamma=4)


def test_sweep_for_periodic_eval(perturbed_pair, prompts):
    """The trainer's periodic evaluation: one temperature, a few γ, models' modes restored."""
    target, draft = perturbed_pair
    draft.train()  # as the trainer would call it
    try:
        settings = Settings(gammas=[1, 3], max_new_tokens=8)
        result, _ = sweep(target, draft, prompts[:2], settings)
        assert draft.training and not target.training  # modes restored
    finally:
        draft.eval()
    best = result["best_gamma"]["0"]
    tau = {c["gamma"]: c["tau"] for c in result["configs"]}
    speedup = {c["gamma"]: c["speedup"] for c in result["configs"]}
    assert best["measured"] in (1, 3)
    assert set(tau) == {1, 3} and all(1.0 <= t <= g + 1 for g, t in tau.items())
    assert speedup[best["measured"]] == best["speedup"] > 0


def test_sweep_repeats_keep_each_configurations_fastest_run(perturbed_pair, prompts, monkeypatch):
    from specdistill.eval import sweep as sweep_module

    calls = []
    real = sweep_module._run

    def spy(*args, gamma=None, **kwargs):
        g = real(*args, **kwargs) if gamma is None else real(*args, gamma=gamma, **kwargs)
        calls.append(("adaptive" if isinstance(gamma, engine.AdaptiveGamma) else gamma, g))
        return g

    monkeypatch.setattr(sweep_module, "_run", spy)
    settings = Settings(gammas=[1, 3], adaptive=True, max_new_tokens=8, repeats=3)
    result, runs = sweep(*perturbed_pair, prompts[:2], settings)
    assert [name for name, _ in calls] == [None, 1, 3, "adaptive"] * 3  # round-robin
    for name, key in [(None, "T=0 target-only"), (1, "T=0 gamma=1"), (3, "T=0 gamma=3")]:
        mine = [g for n, g in calls if n == name]
        assert runs[key].wall_s == min(g.wall_s for g in mine)
        assert all(g.sequences == mine[0].sequences for g in mine)  # the same computation
    adaptive = [g for n, g in calls if n == "adaptive"]
    assert all(g.rounds[0].gamma == 3 for g in adaptive)  # every repeat starts at start = 3
    assert runs["T=0 adaptive"] in adaptive
    with pytest.raises(ValueError, match="repeats"):
        Settings(gammas=[1], repeats=0)


def test_rejects_bad_arguments(perturbed_pair, prompts):
    with pytest.raises(ValueError, match="gamma must be"):
        engine.generate(*perturbed_pair, prompts, gamma=0)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(*perturbed_pair, prompts, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate(*perturbed_pair, [[]])
    assert math.isnan(metrics.percentiles([math.nan])["p50"])
