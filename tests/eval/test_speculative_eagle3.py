"""The speculative decoding engine drafting with an EAGLE-3 head: greedy output equal to the
target's, lossless sampling (chi-square, with a truncated draft vocabulary), the pathwise τ,
and the evaluation report."""

import copy

import pytest
import torch
from scipy import stats
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill import losses
from specdistill.drafts import Eagle3
from specdistill.drafts.eagle3 import Eagle3Drafter
from specdistill.drafts.eagle3.head import Eagle3Head, build_vocab_map
from specdistill.eval import engine, verify
from specdistill.eval import stats as metrics
from specdistill.eval.sweep import Settings, sweep
from specdistill.losses import sampling
from tests.eval.helpers import reference_greedy


def target_model(seed: int, *, vocab: int, hidden: int, layers: int, init: float, attn=0.03):
    """A random target whose next token depends mostly on the current one (attention outputs
    scaled by `attn`): a chaotic random transformer leaves a head that sees it for a few
    hundred steps nothing it can generalise, while real targets are far more predictable."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=init,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(attn)
    return model


def fit_head(target, head: Eagle3Head, steps: int, seq: int = 24, seed: int = 0) -> Eagle3Head:
    """A few hundred Adam steps of TTT on random text, so the head agrees with the target
    often but not always."""
    kind = Eagle3(head, steps=3, vocab_size=head.config.vocab_size)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    head.train()
    for _ in range(steps):
        ids = torch.randint(0, head.config.vocab_size, (8, seq), generator=g)
        batch = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "loss_mask": torch.ones_like(ids, dtype=torch.bool),
        }
        loss, n, _ = losses.multi_depth_loss("fkl", *kind.depths(head, target, batch), d2t=kind.d2t)
        (loss / n).backward()
        optimizer.step()
        optimizer.zero_grad()
    return head.eval()


N_NEW = 24


@pytest.fixture(scope="module")
def head_pair():
    """(target, head): a predictable tiny target and an EAGLE-3 head fitted to it (V_d 80)."""
    target = target_model(0, vocab=96, hidden=64, layers=2, init=0.2)
    head = Eagle3Head.from_target(target, aux_layers=[0, 1], draft_vocab_size=80)
    head.set_vocab_map(*build_vocab_map(torch.arange(96.0), 80), target.lm_head.weight)
    return target, fit_head(target, head, steps=150)


@pytest.fixture(scope="module")
def head_references(head_pair, prompts):
    """The head pair's target's own greedy continuation of each prompt (N_NEW tokens)."""
    return [reference_greedy(head_pair[0], p, N_NEW) for p in prompts]


@pytest.mark.parametrize("gamma", [1, 2, 5])
@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_greedy_with_a_head_equals_target_greedy(
    head_pair, prompts, head_references, gamma, batch_size
):
    target, head = head_pair
    out = engine.generate(
        target, head, prompts, gamma=gamma, batch_size=batch_size, max_new_tokens=N_NEW
    )
    assert out.sequences == head_references
    accepted = [n for r in out.rounds for n in r.accepted]
    # Rejections and (for short γ) full acceptance both happen, so both paths are exercised.
    assert sum(n < gamma for n in accepted) > 0
    if gamma <= 2:
        assert sum(n == gamma for n in accepted) > 0
    else:
        assert any(0 < n < gamma for n in accepted)


def test_greedy_with_a_head_adaptive_eos_and_length(head_pair, prompts, head_references):
    target, head = head_pair
    policy = engine.AdaptiveGamma(start=2, min_gamma=1, max_gamma=6)
    out = engine.generate(target, head, prompts, gamma=policy, max_new_tokens=N_NEW)
    assert out.sequences == head_references
    eos = head_references[1][7]
    cut = head_references[1][: head_references[1].index(eos) + 1]
    out = engine.generate(
        target, head, [prompts[1]], gamma=3, max_new_tokens=N_NEW, eos_token_id=eos
    )
    assert out.sequences == [cut]
    # The first token comes from the target's prefill: one token finishes at admission.
    out = engine.generate(target, head, prompts, gamma=4, max_new_tokens=1)
    assert out.sequences == [r[:1] for r in head_references] and not out.rounds
    out = engine.generate(target, head, prompts, gamma=6, max_new_tokens=5, batch_size=2)
    assert out.sequences == [r[:5] for r in head_references]


def test_greedy_pathwise_tau_matches_measured_for_a_head(head_pair, prompts):
    """Per-depth teacher-forced α along the greedy text reproduces every round exactly."""
    target, head = head_pair
    out = engine.generate(target, head, prompts, gamma=4, batch_size=1, max_new_tokens=N_NEW)
    alphas = [
        metrics.positional_alpha(target, head, p, o, temperature=0.0, depth=4)
        for p, o in zip(prompts, out.sequences, strict=True)
    ]
    measured = metrics.acceptance_stats(out.rounds)["tau"]
    assert metrics.pathwise_tau(out.rounds, alphas) == pytest.approx(measured, abs=1e-12)


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_tau_rounds_matches_measured_for_a_head(head_pair, prompts, gamma):
    """Per-depth α along the target's greedy text, rounds replayed from s = 1 (the first token
    is the target's): `tau_rounds` equals the engine's τ without knowing its round starts."""
    target, head = head_pair
    out = engine.generate(target, head, prompts, gamma=gamma, batch_size=1, max_new_tokens=N_NEW)
    greedy = engine.generate(target, None, prompts, max_new_tokens=N_NEW).sequences
    alphas = [
        metrics.positional_alpha(target, head, p, o, temperature=0.0, depth=gamma)
        for p, o in zip(prompts, greedy, strict=True)
    ]
    measured = metrics.acceptance_stats(out.rounds)["tau"]
    assert metrics.tau_rounds_pooled(alphas, gamma) == pytest.approx(measured, abs=1e-12)


def test_report_runs_with_a_head(head_pair, prompts):
    target, head = head_pair
    settings = Settings(gammas=[2, 4], temperatures=(0.0, 1.0), max_new_tokens=12)
    result, runs = sweep(target, head, prompts[:3], settings)
    configs = {c["name"]: c for c in result["configs"]}
    assert set(configs) == {"T=0 gamma=2", "T=0 gamma=4", "T=1 gamma=2", "T=1 gamma=4"}
    for c in configs.values():
        assert 1.0 <= c["tau"] <= c["gamma"] + 1
        assert len(c["alpha_offline_depth"]) == c["gamma"]
    assert configs["T=0 gamma=4"]["tau_pred_pathwise"] == pytest.approx(
        configs["T=0 gamma=4"]["tau"]
    )


# ----------------------------------------------------------------------------- sampling

V_SMALL = 8
N_SAMPLES = 12_000
PREFIX = [1, 5, 2]


@pytest.fixture(scope="module")
def small_head_pair():
    """A head over 6 of the 8 tokens: tokens 6 and 7 can only come from the residual or bonus."""
    target = target_model(0, vocab=V_SMALL, hidden=32, layers=2, init=0.2)
    head = Eagle3Head.from_target(target, aux_layers=[0, 1], draft_vocab_size=6)
    head.set_vocab_map(*build_vocab_map(torch.arange(V_SMALL, 0, -1.0), 6), target.lm_head.weight)
    return target, fit_head(target, head, steps=60, seq=8)


@torch.no_grad()
def joint_first_three(target, temperature: float) -> torch.Tensor:
    """Exact target distribution of the first three generated tokens: [V³] float64."""

    def probs(prefixes):
        logits = target(input_ids=torch.tensor(prefixes)).logits[:, -1]
        return sampling.probabilities(logits, temperature).double()

    p1 = probs([PREFIX])[0]
    p2 = probs([PREFIX + [a] for a in range(V_SMALL)])
    p3 = probs([PREFIX + [a, b] for a in range(V_SMALL) for b in range(V_SMALL)])
    return (p1[:, None, None] * p2[:, :, None] * p3.view(V_SMALL, V_SMALL, V_SMALL)).flatten()


def chi_square_pvalue(samples: list[list[int]], probs: torch.Tensor) -> float:
    first = torch.tensor([s[:3] for s in samples])
    cells = (first[:, 0] * V_SMALL + first[:, 1]) * V_SMALL + first[:, 2]
    counts = torch.bincount(cells, minlength=V_SMALL**3).double()
    assert counts[probs == 0].sum() == 0, "a token outside the target's support was emitted"
    counts, expected = counts[probs > 0], probs[probs > 0] * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    statistic = float(((counts - expected) ** 2 / expected).sum())
    return float(stats.chi2.sf(statistic, counts.numel() - 1))


def sample(small_head_pair, gamma: int, temperature: float = 1.0, batch_size=None):
    # Token 1 comes from the target's prefill; tokens 2.. from the first speculative round.
    return engine.generate(
        *small_head_pair,
        [PREFIX] * N_SAMPLES,
        gamma=gamma,
        temperature=temperature,
        max_new_tokens=gamma + 2,
        batch_size=batch_size,
    )


@pytest.mark.parametrize("gamma, temperature, batch_size", [(1, 1.0, None), (2, 0.7, 4000)])
def test_sampling_with_a_head_is_lossless(small_head_pair, gamma, temperature, batch_size):
    out = sample(small_head_pair, gamma, temperature, batch_size)
    first = [n for r in out.rounds for n, s in zip(r.accepted, r.starts, strict=True) if s == 1]
    assert 0.1 < sum(n < gamma for n in first) / len(first) < 0.9  # residual and bonus paths
    outside = sum(t >= 6 for s in out.sequences for t in s[1:3])
    assert outside > 0  # tokens outside V_d do appear (through the residual / bonus)
    assert (
        chi_square_pvalue(out.sequences, joint_first_three(small_head_pair[0], temperature)) > 1e-3
    )


def test_chi_square_catches_a_wrong_residual_with_a_head(small_head_pair, monkeypatch):
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    out = sample(small_head_pair, gamma=2)
    assert chi_square_pvalue(out.sequences, joint_first_three(small_head_pair[0], 1.0)) < 1e-6


def test_chi_square_catches_a_head_q_that_is_not_what_it_sampled(small_head_pair, monkeypatch):
    """Verification must use the very distribution each draft was drawn from."""
    real = Eagle3Drafter.propose

    def skewed(self, gamma, sample, control=None):
        proposal = real(self, gamma, sample, control)
        proposal.q = [(p + 0.3 * p.roll(1, -1)) / 1.3 for p in proposal.q]
        return proposal

    monkeypatch.setattr(Eagle3Drafter, "propose", skewed)
    out = sample(small_head_pair, gamma=1)
    assert chi_square_pvalue(out.sequences, joint_first_three(small_head_pair[0], 1.0)) < 1e-6


def test_bf16_target_with_an_fp32_head(head_pair, prompts):
    """Training keeps fp32 master weights while the target may run in bf16 (periodic eval)."""
    target, head = head_pair
    target_bf16 = copy.deepcopy(target).to(torch.bfloat16)
    references = [reference_greedy(target_bf16, p, 12) for p in prompts[:3]]
    out = engine.generate(target_bf16, head, prompts[:3], gamma=3, max_new_tokens=12)
    assert out.sequences == references
    alphas = metrics.positional_alpha(
        target_bf16, head, prompts[0], out.sequences[0], temperature=0.0, depth=3
    )
    assert len(alphas) == 3
