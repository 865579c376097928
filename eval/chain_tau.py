r"""τ_pred from the draft's own chains: what a round accepts on text the draft wrote itself
(docs/theory.md §1, "Chains").

The offline α of eval/offline.py is teacher-forced: every position is scored on the target's
text. A round's k-th draft is scored on the draft's own k − 1 earlier drafts instead, and off
the training domain a draft's acceptance can change along its own chains in a way held-out
text cannot show. Here the draft samples one chain of γ_max tokens (its type's `chains`, at the
serving temperature) from every start s of the target's continuation of each prompt, and the
target scores the chain. Under speculative sampling draft j is kept with probability
r_j = min(1, p_j(x_j)/q_j(x_j)) given the earlier ones, and E_{x_k~q_k}[r_k] = α_k =
Σ_v min(p_k(v), q_k(v)), so

    c_k(s) = reach_k · α_k,   reach_k = Π_{j<k} r_j,

is an unbiased estimate of the chance that a round starting at s accepts its first k drafts
(`survival`). At temperature 0 the chain is the draft's greedy one and c_k(s) = 1 while the
draft's argmax equals the target's, else 0: exact. One chain of γ_max gives every γ ≤ γ_max.

Two figures, both expected tokens per round with the bonus or correction token, as every τ
of eval/stats.py:

- `ChainTau.starts`: 1 + Σ_{k≤γ} mean_s c_k(s), a round at every start alike;
- `ChainTau.rounds` (tau_pred_chain): the rounds replayed with their own boundaries along
  the texts (`stats.tau_rounds_pooled`), a round from s accepting exactly n drafts with
  probability c_n(s) − c_{n+1}(s). Rounds start right after a rejection, at positions harder
  than average; at temperature 0 this replays the engine's rounds exactly.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specdistill import losses
from specdistill.drafts.chains import Chains
from specdistill.eval import stats
from specdistill.eval.sampling import is_greedy
from specdistill.losses.api import prepare
from specdistill.losses.chain import row_terms
from specdistill.models.kv_cache import eval_mode

# The draft's greedy chain, through the types' sampled `chains`: softmax(logits / 1e-6)
# leaves no mass off the argmax unless two logits lie within about 1e-4 of each other.
GREEDY_CHAIN_TEMPERATURE = 1e-6
STARTS_PER_CALL = 32  # chain starts per `chains` call: bounds the tree's length and memory


@dataclass(frozen=True)
class ChainTau:
    """τ_pred per γ = 1..γ_max from the draft's own chains (module docstring): `rounds`
    (round-aware, tau_pred_chain), `starts` (every start alike) and its standard error
    `starts_se` over the chains, `n_chains` chains along `n_texts` texts."""

    rounds: dict[int, float]
    starts: dict[int, float]
    starts_se: dict[int, float]
    n_chains: int
    n_texts: int


def survival(
    chains: Chains,
    *,
    temperature: float,
    top_p: float | None = None,
    top_k: int | None = None,
    d2t: Tensor | None = None,
) -> Tensor:
    """c_k = Π_{j<k} r_j · α_k of each chain: [N, γ] float64 (module docstring). The target is
    filtered by top-p / top-k as the verifier filters it, the draft is not; `d2t`: the draft
    type's map when its chains are over a smaller vocabulary. Greedy temperatures: the
    product of argmax agreements along the chain."""
    if is_greedy(temperature):
        agree = losses.acceptance(chains.draft, chains.target, 0.0, d2t=d2t)
        return agree.double().cumprod(-1)
    prepared = prepare(
        chains.draft,
        chains.target,
        None,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        d2t=d2t,
        mask_out_of_vocab=False,
    )
    terms = row_terms(prepared.draft_logp, prepared.target_logp, chains.tokens)
    log_alpha = terms.log_alpha.double()
    reach = torch.cat([torch.zeros_like(log_alpha[:, :1]), terms.log_r.double().cumsum(-1)], -1)
    return (reach + log_alpha).exp()


def own_chains(
    kind,
    target,
    draft,
    batch: dict,
    starts: list[int],
    *,
    max_gamma: int,
    temperature: float,
    generator: torch.Generator,
) -> Chains:
    """The draft's chains of `max_gamma` positions from `starts` of `batch`, scored by the
    target: its type's `chains` (drafts/chains.py), at `temperature`, or the greedy chain at
    a greedy one (`GREEDY_CHAIN_TEMPERATURE`)."""
    gamma = max(max_gamma, 2)  # a chain of 1 samples no token, which not every type takes
    chains = kind.chains(
        draft,
        target,
        batch,
        starts,
        gamma=gamma,
        temperature=GREEDY_CHAIN_TEMPERATURE if is_greedy(temperature) else temperature,
        generator=generator,
    )
    if gamma == max_gamma:
        return chains
    return Chains(
        chains.draft[:, :max_gamma],
        chains.target[:, :max_gamma],
        chains.tokens[:, : max_gamma - 1],
        chains.mask,
    )


def first_start(kind) -> int:
    """The output position of a text's first round: 1 for a type whose α depends on the
    drafting depth (an EAGLE-3 head: the target's prefill gives the first token), else 0,
    as `stats.round_counts` takes it for the alphas `offline.tau_rounds_pred` hands it."""
    return 1 if kind.per_depth_alpha else 0


@torch.no_grad()
def text_survival(
    kind,
    target,
    draft,
    prompt: Sequence[int],
    output: Sequence[int],
    *,
    max_gamma: int,
    temperature: float,
    generator: torch.Generator,
    top_p: float | None = None,
    top_k: int | None = None,
) -> Tensor:
    """[S, max_gamma] float64: `survival` of one chain from each output position s =
    first_start(kind) .. len(output) − 2 (a round from a later start is shortened at every γ)
    of the text prompt + output. `kind`: a draft type instance (drafts/), `draft` its bare
    module."""
    n, length = len(prompt), len(output)
    positions = list(range(first_start(kind), length - 1))
    if not positions:
        return torch.zeros(0, max_gamma, dtype=torch.float64)
    ids = torch.tensor([list(prompt) + list(output)], device=target.device)
    ones = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": ones, "loss_mask": ones.bool()}
    parts = []
    for i in range(0, len(positions), STARTS_PER_CALL):
        starts = [n - 1 + s for s in positions[i : i + STARTS_PER_CALL]]  # chain 1 predicts s
        chains = own_chains(
            kind,
            target,
            draft,
            batch,
            starts,
            max_gamma=max_gamma,
            temperature=temperature,
            generator=generator,
        )
        c = survival(chains, temperature=temperature, top_p=top_p, top_k=top_k, d2t=kind.d2t)
        parts.append(c.cpu())
    return torch.cat(parts)


def conditional_rows(c: Tensor, first: int, length: int) -> list[list[float]]:
    """`stats.round_counts`' per-depth alphas from the chains' survival c [S, γ] of a text of
    `length` output tokens: rows[k][s] = c_{k+1}(s) / c_k(s) (c_0 = 1; 0 where c_k = 0), so
    that the round from s accepts exactly n drafts with probability c_n(s) − c_{n+1}(s);
    0 at the positions without a chain."""
    prev = torch.cat([torch.ones_like(c[:, :1]), c[:, :-1]], -1)
    ratio = torch.where(prev > 0, c / prev.clamp_min(1e-300), 0.0)
    rows = torch.zeros(c.shape[1], length + 1, dtype=torch.float64)
    rows[:, first : first + len(c)] = ratio.T
    return rows.tolist()


def summarise_chains(
    survivals: list[Tensor], lengths: list[int], *, first: int, max_gamma: int
) -> ChainTau:
    """`ChainTau` from each text's `text_survival` [S, max_gamma] and its number of output
    tokens; the γ without an uncapped round (or without a chain) are left out."""
    every = torch.cat([torch.zeros(0, max_gamma, dtype=torch.float64), *survivals])
    texts = [conditional_rows(c, first, n) for c, n in zip(survivals, lengths, strict=True)]
    rounds, starts, se = {}, {}, {}
    for g in range(1, max_gamma + 1):
        tau = stats.tau_rounds_pooled(texts, g, first=first)
        if tau == tau:  # not NaN: some text has an uncapped round
            rounds[g] = tau
        if len(every):
            accepted = every[:, :g].sum(-1)  # per chain: Σ_{k≤γ} c_k
            starts[g] = 1.0 + float(accepted.mean())
            se[g] = float(accepted.std() / len(every) ** 0.5) if len(every) > 1 else 0.0
    return ChainTau(rounds, starts, se, len(every), len(survivals))


def chain_tau_pred(
    kind,
    target,
    draft,
    prompts: list[list[int]],
    outputs: list[list[int]],
    *,
    temperature: float,
    max_gamma: int,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int = 0,
) -> ChainTau:
    """`ChainTau` for γ = 1..max_gamma along the target's continuations `outputs` of
    `prompts` (eval/offline.py `held_out_texts`), one seeded chain per start. `kind`: the
    draft's type instance (drafts/; its `chains`), `draft` its bare module (no DDP wrapper);
    both models run in eval mode."""
    generator = torch.Generator(device=target.device).manual_seed(seed)
    with eval_mode(target, draft):
        survivals = [
            text_survival(
                kind,
                target,
                draft,
                p,
                o,
                max_gamma=max_gamma,
                temperature=temperature,
                generator=generator,
                top_p=top_p,
                top_k=top_k,
            )
            for p, o in zip(prompts, outputs, strict=True)
        ]
    lengths = [len(o) for o in outputs]
    return summarise_chains(survivals, lengths, first=first_start(kind), max_gamma=max_gamma)
