"""Tiny random Llama targets and perturbed copies of them as drafts, the target's own greedy
decode, and a χ² test of the first two sampled tokens against the target's exact distribution,
for the speculative engine's tests."""

import copy

import torch
from scipy import stats
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill.eval import engine
from specdistill.losses import sampling

N_NEW = 24  # tokens generated per prompt in the greedy tests
V_SMALL = 8  # the χ² tests' vocabulary: V² cells for the first two tokens
N_SAMPLES = 20_000
PREFIX = [1, 5, 2]


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


@torch.no_grad()
def joint_first_two(target, temperature, top_p, top_k) -> torch.Tensor:
    """Exact target distribution of the first two generated tokens: [V*V] float64."""
    p1 = sampling.probabilities(
        target(input_ids=torch.tensor([PREFIX])).logits[0, -1], temperature, top_p, top_k
    )
    ids = torch.tensor([PREFIX + [x] for x in range(V_SMALL)])
    p2 = sampling.probabilities(target(input_ids=ids).logits[:, -1], temperature, top_p, top_k)
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


def sample_pairs(pair, gamma, temperature=1.0, top_p=None, top_k=None, seed=0, batch_size=None):
    # γ + 1 new tokens so the first round is not shortened by the length limit.
    return engine.generate(
        *pair,
        [PREFIX] * N_SAMPLES,
        gamma=gamma,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=gamma + 1,
        seed=seed,
        batch_size=batch_size,
    )


def drift_argv(draft, target, prompts, out, *extra):
    """`specdistill drift` arguments: one target before and after, small and quick."""
    return [
        "--draft", str(draft), "--target-before", str(target), "--target-after", str(target),
        "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "6",
        "--bootstrap", "100", "--min-samples", "4", "--device", "cpu", *extra,
    ]  # fmt: skip
