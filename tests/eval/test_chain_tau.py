"""τ_pred from the draft's own chains (eval/chain_tau.py): the estimator against the exact
expectation over every draft chain of a tiny vocabulary, exact at T = 0, and along whole texts
equal to the engine's measured τ at T = 0 (a standalone draft and an EAGLE-3 head)."""

import math

import pytest
import torch

from specdistill import losses
from specdistill.drafts import Eagle3, Standalone
from specdistill.drafts.eagle3.head import Eagle3Head, build_vocab_map
from specdistill.eval import engine, stats
from specdistill.eval.chain_tau import (
    chain_tau_pred,
    own_chains,
    summarise_chains,
    survival,
)
from specdistill.eval.offline import held_out_texts
from specdistill.losses.sampling import probabilities
from tests.eval.helpers import N_NEW, perturbed, tiny_llama

V = 5  # every chain of γ − 1 = 2 sampled tokens: 25 of them
GAMMA = 3
PREFIX = [1, 4, 2, 0]
N_CHAINS = 6000


@pytest.fixture(scope="module")
def five_token_pair():
    """(target, draft) over V tokens: the draft a perturbed copy whose α at PREFIX (0.63)
    differs from its α further along its own chains; its argmax agrees for two positions."""
    target = tiny_llama(0, vocab=V, hidden=16, layers=1, init=0.6)
    return target, perturbed(target, 0.06, seed=2)


def next_dists(target, draft, ids, temperature, top_k):
    """(p, q) at the end of `ids`: p filtered as the verifier filters it, q unfiltered."""
    x = torch.tensor([ids])
    t_logits, d_logits = target(input_ids=x).logits[0, -1], draft(input_ids=x).logits[0, -1]
    if temperature == 0:
        return t_logits, d_logits
    return probabilities(t_logits.double(), temperature, None, top_k), probabilities(
        d_logits.double(), temperature
    )


@torch.no_grad()
def exact_tau(target, draft, temperature, top_k=None) -> list[float]:
    """E[τ](γ) for γ = 1..GAMMA by enumeration: 1 + Σ_{k≤γ} P(the first k drafts accepted),
    P summing Π_{j≤k} min(p_j(x_j), q_j(x_j)) over every chain x_1..x_k (speculative
    sampling proposes x_j with q_j(x_j) and keeps it with min(1, p_j/q_j)); at T = 0 the
    draft's argmax chain, kept while it equals the target's argmax."""
    accepted = [0.0] * GAMMA

    def walk(ids, weight, depth):
        p, q = next_dists(target, draft, ids, temperature, top_k)
        if temperature == 0:
            agree = int(p.argmax()) == int(q.argmax())
            accepted[depth] += weight * agree
            if agree and depth + 1 < GAMMA:
                walk(ids + [int(q.argmax())], weight, depth + 1)
            return
        both = torch.minimum(p, q)
        accepted[depth] += weight * float(both.sum())
        if depth + 1 < GAMMA:
            for x in range(V):
                walk(ids + [x], weight * float(both[x]), depth + 1)

    walk(list(PREFIX), 1.0, 0)
    return [1.0 + sum(accepted[:g]) for g in range(1, GAMMA + 1)]


@torch.no_grad()
def sampled_tau(target, draft, temperature, top_k=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The estimator at PREFIX over N_CHAINS independent chains: (τ per γ, its standard
    error), chains from a repeated start of 40 identical rows."""
    rows = 40
    ids = torch.tensor([PREFIX + [0]] * rows)  # the extra token makes the start count
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    batch["loss_mask"] = batch["attention_mask"].bool()
    starts = [len(PREFIX) - 1] * (N_CHAINS // rows)
    chains = own_chains(
        Standalone(V),
        target,
        draft,
        batch,
        starts,
        max_gamma=GAMMA,
        temperature=temperature,
        generator=torch.Generator().manual_seed(0),
    )
    assert bool(chains.mask.all())
    per_chain = survival(chains, temperature=temperature, top_k=top_k).cumsum(-1)
    return 1.0 + per_chain.mean(0), per_chain.std(0) / math.sqrt(len(per_chain))


@pytest.mark.parametrize("top_k", [None, 3])
def test_sampled_chains_match_the_enumeration(five_token_pair, top_k):
    target, draft = five_token_pair
    exact = torch.tensor(exact_tau(target, draft, 1.0, top_k), dtype=torch.float64)
    estimate, se = sampled_tau(target, draft, 1.0, top_k)
    assert torch.all((estimate - exact).abs() <= 4 * se + 1e-6), (estimate, exact, se)
    assert float(se[-1]) < 0.02  # tight enough that a wrong model would show


def test_a_wrong_estimator_misses_the_enumeration(five_token_pair):
    """The i.i.d. formula on the first position's α (what teacher-forced α at a prefix says)
    is off where α changes along the draft's own chain: the enumeration tells them apart."""
    target, draft = five_token_pair
    exact = exact_tau(target, draft, 1.0)
    alpha = exact[0] - 1.0
    _, se = sampled_tau(target, draft, 1.0)
    iid = stats.tau_iid(alpha, GAMMA)
    assert abs(iid - exact[-1]) > 10 * float(se[-1]), (iid, exact, se)


def test_greedy_chain_is_exact(five_token_pair):
    target, draft = five_token_pair
    exact = exact_tau(target, draft, 0.0)
    estimate, se = sampled_tau(target, draft, 0.0)
    assert estimate.tolist() == exact == [2.0, 3.0, 3.0]  # agrees twice, then not
    assert se.abs().max() == 0.0


def test_constant_survival_gives_the_iid_formula():
    """c_k = α^k at every start: the rounds form a renewal process, τ = (1 − α^(γ+1))/(1 − α)."""
    alpha, gamma, length = 0.6, 4, 2001
    c = torch.tensor([alpha**k for k in range(1, gamma + 1)], dtype=torch.float64)
    result = summarise_chains([c.repeat(length - 1, 1)], [length], first=0, max_gamma=gamma)
    for g in range(1, gamma + 1):
        assert result.rounds[g] == pytest.approx(stats.tau_iid(alpha, g), rel=1e-9)
        assert result.starts[g] == pytest.approx(stats.tau_iid(alpha, g), rel=1e-12)
    assert result.n_chains == length - 1 and result.n_texts == 1


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_chain_rounds_equal_the_engine(perturbed_pair, prompts, gamma):
    """At T = 0 the chains along the target's greedy texts replay the engine's rounds."""
    target, draft = perturbed_pair
    outputs = held_out_texts(target, prompts, temperature=0.0, max_new_tokens=N_NEW)
    out = engine.generate(target, draft, prompts, gamma=gamma, batch_size=1, max_new_tokens=N_NEW)
    measured = stats.acceptance_stats(out.rounds)["tau"]
    kind = Standalone(target.config.vocab_size)
    pred = chain_tau_pred(kind, target, draft, prompts, outputs, temperature=0.0, max_gamma=5)
    assert pred.rounds[gamma] == pytest.approx(measured, abs=1e-12)
    assert 1.0 < measured < gamma + 1


def fitted_head(target) -> Eagle3Head:
    """An EAGLE-3 head fitted for a few Adam steps to a tiny target (V_d 80 of 96), so that
    it agrees with the target's argmax often but not always."""
    head = Eagle3Head.from_target(target, aux_layers=[0, 1], draft_vocab_size=80)
    head.set_vocab_map(*build_vocab_map(torch.arange(96.0), 80), target.lm_head.weight)
    kind = Eagle3(head, steps=3, vocab_size=96)
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(0)
    head.train()
    for _ in range(120):
        ids = torch.randint(0, 96, (8, 24), generator=g)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        batch["loss_mask"] = batch["attention_mask"].bool()
        loss, n, _ = losses.multi_depth_loss("fkl", *kind.depths(head, target, batch), d2t=kind.d2t)
        (loss / n).backward()
        optimizer.step()
        optimizer.zero_grad()
    return head.eval()


def test_greedy_head_chain_rounds_equal_the_engine(prompts):
    """An EAGLE-3 head's chains (its own `chains`, d2t-mapped), its first round after the
    target's first token: at T = 0 the replay equals the engine's τ."""
    target = tiny_llama(0, vocab=96, hidden=64, layers=2, init=0.2)
    with torch.no_grad():
        for layer in target.model.layers:  # the next token mostly follows the current one
            layer.self_attn.o_proj.weight.mul_(0.03)
    head = fitted_head(target)
    kind = Eagle3(head, steps=3, vocab_size=96)
    outputs = held_out_texts(target, prompts, temperature=0.0, max_new_tokens=N_NEW)
    pred = chain_tau_pred(kind, target, head, prompts, outputs, temperature=0.0, max_gamma=4)
    for gamma in (1, 4):
        out = engine.generate(
            target, head, prompts, gamma=gamma, batch_size=1, max_new_tokens=N_NEW
        )
        measured = stats.acceptance_stats(out.rounds)["tau"]
        assert pred.rounds[gamma] == pytest.approx(measured, abs=1e-12)
        assert 1.0 < measured
