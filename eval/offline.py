"""Offline acceptance: α of a draft against its target on held-out token sequences.

α per position is Σ_x min(p(x), q(x)) at the verifier's temperature (docs/theory.md §1);
at temperature 0 it is argmax agreement. The predicted accepted length per round for a
draft of γ tokens, with i.i.d. acceptance α, is τ(γ) = (1 − α^(γ+1)) / (1 − α),
bonus token included, so τ ∈ [1, γ + 1] (`eval.stats.tau_iid`; per depth `tau_chain`).

That model misses the measured τ (issue 15): real rounds start right after a rejection, at
positions harder than average. `held_out_texts` has the target continue a few held-out
prompts once per run; `tau_rounds_pred` replays rounds with their real boundaries along them
(`eval.stats.tau_rounds`) for the current draft. `summarise(..., tau_rounds=...)` reports
that as tau_pred and keeps the i.i.d. / chained value as tau_pred_iid. Off the training
domain the draft's acceptance can also change along its own drafts, which teacher-forced
text cannot show: eval/chain_tau.py scores the draft's own chains (tau_pred_chain).
"""

from collections.abc import Iterable

import torch

from specdistill import drafts as draft_types
from specdistill import losses
from specdistill.errors import UserError
from specdistill.eval import stats
from specdistill.eval.engine import generate
from specdistill.eval.stats import tau_chain, tau_iid


@torch.no_grad()
def acceptance_sums(
    kind, target, draft, batches: Iterable[dict], *, temperature: float
) -> torch.Tensor:
    """Sums over valid positions per draft depth: [K, 3] float64 rows (Σ α_T, Σ α_greedy, n).

    `kind` is a draft type of drafts/ (standalone: K = 1; eagle3: K = TTT steps).
    Returned as sums so that callers running on several processes can all-reduce them.
    """
    sums = None
    for batch in batches:
        drafts, targets, masks = kind.depths(draft, target, batch)
        if sums is None:
            sums = torch.zeros(len(drafts), 3, dtype=torch.float64)
        for k, (d_logits, t_logits, mask) in enumerate(zip(drafts, targets, masks, strict=True)):
            alpha = losses.acceptance(d_logits, t_logits, temperature, mask, d2t=kind.d2t)
            greedy = losses.acceptance(d_logits, t_logits, 0.0, mask, d2t=kind.d2t)
            sums[k, 0] += alpha.double().sum().cpu()
            sums[k, 1] += greedy.double().sum().cpu()
            sums[k, 2] += mask.sum().cpu()
    if sums is None:
        raise UserError("no evaluation batches")
    return sums


def summarise(
    sums: torch.Tensor,
    *,
    temperature: float,
    max_gamma: int,
    tau_rounds: dict[int, float] | None = None,
    tau_chains: dict[int, float] | None = None,
) -> dict:
    """Turn `acceptance_sums` (possibly all-reduced; [3] or [K, 3]) into the reported metrics.

    One depth: the i.i.d. formula on the mean α. K depths (EAGLE-3 TTT): `alpha_depth` lists
    the teacher-forced α of each depth and they are chained (docs/theory.md §1), the last
    depth's α standing in for deeper drafts. That value is tau_pred_iid; tau_pred is
    `tau_rounds` ({γ: τ} from `tau_rounds_pred`) when given, else the same i.i.d. value.
    `tau_chains` ({γ: τ} from the draft's own chains, eval/chain_tau.py), when given, is
    reported as tau_pred_chain.
    """
    sums = sums.reshape(-1, 3)
    n = int(sums[0, 2].item())
    if n == 0:
        raise UserError("no valid positions in the evaluation data (empty loss mask)")
    per_depth = [float(s[0] / s[2]) if s[2] > 0 else 0.0 for s in sums]
    alpha = per_depth[0]
    result = {
        "alpha": alpha,
        "alpha_greedy": float(sums[0, 1] / n),
        "temperature": temperature,
        "n_positions": n,
    }
    if len(per_depth) == 1:
        result["tau_pred"] = {g: tau_iid(alpha, g) for g in range(1, max_gamma + 1)}
    else:
        result["alpha_depth"] = per_depth
        result["alpha_greedy_depth"] = [float(s[1] / s[2]) if s[2] > 0 else 0.0 for s in sums]
        result["tau_pred"] = {g: tau_chain(per_depth, g) for g in range(1, max_gamma + 1)}
    result["tau_pred_iid"] = dict(result["tau_pred"])
    if tau_rounds:
        result["tau_pred"] = {
            g: tau_rounds.get(g, result["tau_pred"][g]) for g in result["tau_pred"]
        }
    if tau_chains:
        result["tau_pred_chain"] = dict(tau_chains)
    return result


@torch.no_grad()
def held_out_texts(
    target,
    prompts: list[list[int]],
    *,
    temperature: float,
    max_new_tokens: int,
    seed: int = 0,
    top_p: float | None = None,
    top_k: int | None = None,
) -> list[list[int]]:
    """The target's own continuations of `prompts` (greedy at T = 0, sampled at T > 0),
    generated once per run: the text `tau_rounds_pred` replays rounds along. No EOS stop,
    so every text has max_new_tokens tokens."""
    out = generate(
        target,
        None,
        prompts,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        seed=seed,
    )
    return out.sequences


def tau_rounds_pred(
    target,
    draft,
    prompts: list[list[int]],
    outputs: list[list[int]],
    *,
    temperature: float,
    max_gamma: int,
    top_p: float | None = None,
    top_k: int | None = None,
) -> dict[int, float]:
    """{γ: τ} for γ = 1..max_gamma with the real round boundaries (`stats.tau_rounds`),
    pooled over the texts as the engine pools rounds, from the draft's offline α along the
    target's texts (`held_out_texts`). Pass the bare models (no DDP wrapper). γ whose texts
    are too short for one uncapped round (max_new_tokens ≤ γ + 1) are left out."""
    per_depth = draft_types.type_of(draft).per_depth_alpha
    alphas = [
        stats.positional_alpha(
            target,
            draft,
            p,
            o,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            depth=max_gamma if per_depth else 1,
        )
        for p, o in zip(prompts, outputs, strict=True)
    ]
    result = {}
    for g in range(1, max_gamma + 1):
        tau = stats.tau_rounds_pooled(alphas, g)
        if tau == tau:  # not NaN
            result[g] = tau
    return result
