"""What speculative decoding measures, and what the models of it predict (docs/theory.md §1).

The τ formulas (tokens committed per round, bonus or correction token included, so
τ ∈ [1, γ + 1]): `tau_iid` for one acceptance α at every slot, `tau_chain` for per-slot
acceptances α_i. Measured: `acceptance_stats` over an engine run's rounds. Predicted along
the generated text: `positional_alpha` (offline α, `losses.acceptance`), `pathwise_tau` (at
the measured rounds' starts) and `tau_rounds` (the rounds replayed with their own boundaries,
no engine run needed: what training reports as tau_pred).
The speedup model (Leviathan et al. 2023, Thm 3.8): `speedup_model`, `best_gamma_model`,
with the cost ratios `cost_ratios` measures. Intervals: `bootstrap_indices` (the paired
resampling every bootstrap in the project draws), `percentile_interval`, and `tau_interval`
(measured τ over prompts).
"""

import math
from collections.abc import Sequence
from itertools import takewhile

import numpy as np
import torch

from specdistill import drafts, losses
from specdistill.eval.engine import Round
from specdistill.models.kv_cache import eval_mode

# ----------------------------------------------------------------------------- τ formulas


# How far an α summed in floating point (Σ min(p, q)) may stray outside [0, 1]: a draft that
# is its target gives 1 + 7e-9 in float32.
ALPHA_ROUNDING = 1e-5


def tau_iid(alpha: float, gamma: int) -> float:
    """Expected tokens per round for i.i.d. acceptance `alpha`: (1 − α^(γ+1)) / (1 − α);
    α within `ALPHA_ROUNDING` outside [0, 1] is rounding and is clamped."""
    if not -ALPHA_ROUNDING <= alpha <= 1.0 + ALPHA_ROUNDING:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    alpha = min(max(alpha, 0.0), 1.0)
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def tau_chain(alphas: Sequence[float], gamma: int) -> float:
    """τ = 1 + Σ_{j≤γ} Π_{i≤j} α_i for per-slot (per-depth) α; slots past the last reuse it."""
    tau, run = 1.0, 1.0
    for i in range(gamma):
        run *= alphas[min(i, len(alphas) - 1)]
        tau += run
    return tau


# ----------------------------------------------------------------------------- measured


def acceptance_stats(rounds: Sequence[Round]) -> dict:
    """Acceptance metrics over speculative rounds (γ ≥ 1, not length-capped), per row-round
    that proposed drafts (a per-row policy's rows propose their own numbers, `Round.drafted`).

    tau: mean tokens per row-round (accepted drafts + 1), counted per round (docs/theory.md
    §1); slot_acceptance[i-1]: P(slot i accepted | slots < i accepted), over rounds with γ ≥ i;
    rejection_histogram[i-1]: row-rounds whose first rejection was slot i; `no_rejection`
    counts row-rounds that accepted all γ; acceptance_rate: accepted / (accepted + rejections).
    `tau_from_slots` = `tau_chain`(slot_acceptance) equals tau for a fixed γ.
    """
    pairs = [(k, n) for _, k, n in _row_rounds(rounds)]
    if not pairs:
        raise ValueError("no speculative rounds to summarise")
    max_gamma = max(g for g, _ in pairs)
    reached = [0] * max_gamma
    passed = [0] * max_gamma
    rejections = [0] * max_gamma
    for g, n in pairs:
        for i in range(min(n + 1, g)):
            reached[i] += 1
            passed[i] += i < n
        if n < g:
            rejections[n] += 1
    slot = [passed[i] / reached[i] if reached[i] else math.nan for i in range(max_gamma)]
    reached_slots = list(takewhile(lambda rate: not math.isnan(rate), slot))
    n_accepted = sum(n for _, n in pairs)
    n_rejected = sum(rejections)
    return {
        "tau": sum(n + 1 for _, n in pairs) / len(pairs),
        "tau_from_slots": tau_chain(reached_slots, len(reached_slots)),
        "slot_acceptance": slot,
        "rejection_histogram": rejections,
        "no_rejection": len(pairs) - n_rejected,
        "acceptance_rate": n_accepted / (n_accepted + n_rejected)
        if n_accepted + n_rejected
        else 1.0,
        "row_rounds": len(pairs),
        "mean_gamma": sum(g for g, _ in pairs) / len(pairs),
    }


def _row_rounds(rounds: Sequence[Round]) -> list[tuple[int, int, int]]:
    """(request, drafts proposed, drafts accepted) of every row-round `acceptance_stats`
    counts: γ ≥ 1, not length-capped, the row proposed at least one draft."""
    return [
        (request, k, n)
        for r in rounds
        if r.gamma > 0 and not r.capped
        for request, k, n in zip(r.requests, r.row_gammas(), r.accepted, strict=True)
        if k > 0
    ]


def tau_interval(
    rounds: Sequence[Round], confidence: float = 0.95, samples: int = 2000, seed: int = 0
) -> list[float]:
    """[lower, upper]: a percentile bootstrap interval of the pooled τ over prompts.

    A prompt's rounds are resampled together (they share its text, so they are not
    independent): each resample draws prompts with replacement and pools their tokens and
    rounds as `acceptance_stats` does. [nan, nan] with fewer than 2 prompts."""
    per_request: dict[int, list[int]] = {}
    for request, _, n in _row_rounds(rounds):
        totals = per_request.setdefault(request, [0, 0])
        totals[0] += n + 1
        totals[1] += 1
    if len(per_request) < 2:
        return [math.nan, math.nan]
    tokens, counts = np.array(list(per_request.values()), dtype=np.float64).T
    idx = bootstrap_indices(len(tokens), samples, seed)
    return percentile_interval(tokens[idx].sum(axis=1) / counts[idx].sum(axis=1), confidence)


def alpha_for_tau(tau: float, gamma: int) -> float:
    """The i.i.d. α whose expected τ(α, γ) equals `tau` (bisection; τ is increasing in α)."""
    tau = min(max(tau, 1.0), gamma + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tau_iid(mid, gamma) < tau else (lo, mid)
    return (lo + hi) / 2


def alpha_from_counts(num_spec_steps: float, num_draft_tokens: float, num_accepted: float) -> float:
    """Per-token α from a serving engine's counters (vLLM's spec_decode metrics, summed over
    requests): the i.i.d. α whose τ(α, γ) equals the measured mean acceptance length
    1 + accepted / steps, at γ = drafted / steps (rounded). The engines' own
    "draft acceptance rate", accepted / drafted, is not α: the drafts after a rejection
    count as drafted and can never be accepted, so at γ = 4 and α = 0.73 it reads 0.48."""
    if num_spec_steps <= 0 or num_draft_tokens <= 0:
        raise ValueError("no speculative steps to measure")
    gamma = max(1, round(num_draft_tokens / num_spec_steps))
    return alpha_for_tau(1.0 + num_accepted / num_spec_steps, gamma)


def percentiles(values: Sequence[float]) -> dict:
    """p50 / p95 / p99 / mean of the non-NaN values (NaN each when there are none)."""
    data = torch.tensor([v for v in values if not math.isnan(v)], dtype=torch.float64)
    if data.numel() == 0:
        return {"p50": math.nan, "p95": math.nan, "p99": math.nan, "mean": math.nan}
    qs = torch.quantile(data, torch.tensor([0.5, 0.95, 0.99], dtype=torch.float64)).tolist()
    return {"p50": qs[0], "p95": qs[1], "p99": qs[2], "mean": float(data.mean())}


def cost_ratios(spec: Sequence[Round], baseline: Sequence[Round]) -> tuple[float, float]:
    """(c, v) from speculative rounds and target-only rounds (prefill is never in a round).

    c = draft time per drafted token ÷ target time per decoding step (docs/theory.md §1);
    v = verification time per round ÷ target time per decoding step. The ideal speedup
    τ/(γc + 1) assumes v = 1; v > 1 is the extra cost of scoring γ + 1 tokens in one pass
    (on CPUs, matrix-matrix instead of matrix-vector kernels).
    """
    spec_rounds = [r for r in spec if r.gamma > 0]
    if not spec_rounds or not baseline:
        return math.nan, math.nan
    target_per_step = sum(r.verify_s for r in baseline) / len(baseline)
    draft_per_token = sum(r.draft_s for r in spec_rounds) / sum(r.gamma for r in spec_rounds)
    verify_per_round = sum(r.verify_s for r in spec_rounds) / len(spec_rounds)
    return draft_per_token / target_per_step, verify_per_round / target_per_step


# ----------------------------------------------------------------------------- models


def speedup_model(alpha: float, gamma: int, c: float) -> float:
    """Leviathan et al. Thm 3.8: (1 − α^(γ+1)) / ((1 − α)(γc + 1)) (docs/theory.md §1)."""
    return tau_iid(alpha, gamma) / (gamma * c + 1.0)


def best_gamma_model(alpha: float, c: float, max_gamma: int = 16) -> int:
    """The γ in 1..max_gamma that maximises `speedup_model` at (α, c)."""
    return max(range(1, max_gamma + 1), key=lambda g: speedup_model(alpha, g, c))


@torch.inference_mode()
def positional_alpha(
    target,
    draft,
    prompt: Sequence[int],
    output: Sequence[int],
    *,
    temperature: float,
    top_p: float | None = None,
    top_k: int | None = None,
    vocab_size: int | None = None,
    depth: int = 1,
) -> list[float] | list[list[float]]:
    """Offline α along the generated text, teacher-forced on prompt + output.

    α = `losses.acceptance` at the verifier's temperature / top-p / top-k, which filter p only
    (argmax agreement at temperature 0). The draft type (`drafts.type_of`) gives the logits:
    standalone draft: len(output) + 1 floats; entry j is α for the token after
    prompt + output[:j].
    EAGLE-3 head: `depth` lists; entry [k][s] is the α of the k-th draft (0-based) of a round
    that starts at generated position s (it predicts output[s + k]), the head unrolled on the
    teacher-forced text as in training (0 where the text runs out).
    vocab_size: logit columns compared (default: as the engine, the smaller head).
    """
    kind = drafts.type_of(draft)
    vocab_size = vocab_size or drafts.compared_vocab_size(target, draft=draft)
    ids = torch.tensor([list(prompt) + list(output)], device=target.device)
    with eval_mode(target, draft):
        depths = kind.path_logits(target, draft, ids, len(prompt), depth, vocab_size)
    alphas = [
        _alpha(d_logits, t_logits, mask, temperature, top_p, top_k).tolist()
        for d_logits, t_logits, mask in depths
    ]
    return alphas if kind.per_depth_alpha else alphas[0]


def _alpha(d_logits, t_logits, mask, temperature: float, top_p, top_k) -> torch.Tensor:
    """α per row as the verifier sees it: [N, V], [N, V], mask [N] | None -> [N] (0 masked)."""
    return losses.acceptance(d_logits, t_logits, temperature, mask, top_p=top_p, top_k=top_k)


def pathwise_tau(rounds: Sequence[Round], alphas: Sequence) -> float:
    """τ predicted from per-position offline α along the generated text, at the rounds' starts.

    A round that starts at generated position s with γ drafts is predicted to commit
    `tau_chain`(α_1..α_γ) tokens, α_i = alphas[request][s+i−1] (standalone) or
    alphas[request][i−1][s] (EAGLE-3, per depth), from `positional_alpha` (0 past the text).
    At temperature 0 this equals the measured τ exactly (α is argmax agreement on the path);
    at T > 0 it is unbiased for γ = 1 (slot 1 is accepted with probability α_s given the text
    so far), an approximation beyond.
    """
    total, count = 0.0, 0
    for r in rounds:
        if r.gamma == 0 or r.capped:
            continue
        for request, s, k in zip(r.requests, r.starts, r.row_gammas(), strict=True):
            if k == 0:
                continue
            a = alphas[request]
            if bool(a) and isinstance(a[0], list):  # per depth
                slots = [a[i][s] if i < len(a) and s < len(a[i]) else 0.0 for i in range(k)]
            else:
                slots = [a[s + i] if s + i < len(a) else 0.0 for i in range(k)]
            total += tau_chain(slots, k)
            count += 1
    return total / count if count else math.nan


# ----------------------------------------------------------------------------- round boundaries


def _per_depth(alphas) -> bool:
    return bool(alphas) and isinstance(alphas[0], Sequence | torch.Tensor)


def round_counts(alphas, gamma: int, *, first: int | None = None) -> tuple[float, float]:
    """(expected tokens, expected rounds) of γ-draft rounds along one text, counted as
    `acceptance_stats` counts them (docs/theory.md §1, "Round boundaries").

    alphas: offline α along a text of L tokens, as `positional_alpha` returns them:
    standalone draft: L + 1 floats, alphas[j] the α of the draft token predicting output[j];
    EAGLE-3 head: ≥ γ lists of L + 1 floats, alphas[k][s] the α of the k-th draft of a round
    starting at s. first: the first round's start (default 0 standalone, 1 per depth: an
    EAGLE-3 head's first token comes from the target's prefill).

    A round starting at s accepts n < γ drafts with probability Π_{i<n} α_{s+i}·(1 − α_{s+n})
    (per depth: Π_{k<n} α[k][s]·(1 − α[n][s])) and all γ with Π_{i<γ} α_{s+i}; it commits n + 1
    tokens and the next round starts at s + n + 1. Only rounds with s + γ + 1 ≤ L count:
    `generate` shortens γ for the rest (they need fewer than γ + 1 tokens) and
    `acceptance_stats` excludes those capped rounds; once a round is capped every later one
    is, so the counted rounds are those before the first start past L − γ − 1. Dynamic
    program from the end: N(s) = 1 + Σ_n P(n|s)·N(s+n+1), T(s) = Σ_n P(n|s)·(n + 1 + T(s+n+1)),
    N = T = 0 past the last counted start. At temperature 0 (α ∈ {0, 1}) it replays the
    engine's rounds exactly (batch size 1); at T > 0 the α are measured on the target's text,
    not on the accepted drafts (min(p, q)/α), so it is a model.
    """
    if gamma < 1:
        raise ValueError(f"gamma must be ≥ 1, got {gamma}")
    per_depth = _per_depth(alphas)
    if per_depth:
        if len(alphas) < gamma:
            raise ValueError(
                f"per-depth alphas have {len(alphas)} depths, γ = {gamma} needs {gamma}"
            )
        rows = [[float(a) for a in depth] for depth in alphas[:gamma]]
        length = len(rows[0]) - 1
        first = 1 if first is None else first

        def slot(s: int, i: int) -> float:
            return rows[i][s]

    else:
        row = [float(a) for a in alphas]
        length = len(row) - 1
        first = 0 if first is None else first

        def slot(s: int, i: int) -> float:
            return row[s + i]

    last = length - gamma - 1  # the last start whose round is not capped
    if last < first:
        return 0.0, 0.0
    # tokens[s], rounds[s] for s in first..last; starts past `last` contribute nothing.
    tokens = [0.0] * (length + 2)
    rounds = [0.0] * (length + 2)
    for s in range(last, first - 1, -1):
        run, t, r = 1.0, 0.0, 1.0
        for n in range(gamma + 1):
            a = slot(s, n) if n < gamma else 0.0  # all γ accepted: no rejection term
            p = run * (1.0 - a) if n < gamma else run
            if p:
                nxt = s + n + 1
                t += p * (n + 1 + tokens[nxt])
                r += p * rounds[nxt]
            if n < gamma:
                run *= a
        tokens[s], rounds[s] = t, r
    return tokens[first], rounds[first]


def tau_rounds(alphas, gamma: int, *, first: int | None = None) -> float:
    """τ along one text with the real round boundaries: E[tokens] / E[rounds] of
    `round_counts` (NaN when the text is too short for one uncapped round)."""
    t, r = round_counts(alphas, gamma, first=first)
    return t / r if r else math.nan


def tau_rounds_pooled(texts: Sequence, gamma: int, *, first: int | None = None) -> float:
    """τ over several texts, pooled as `acceptance_stats` pools rounds: Σ E[tokens] / Σ
    E[rounds] (each text's alphas as `round_counts` takes them)."""
    t = r = 0.0
    for alphas in texts:
        dt, dr = round_counts(alphas, gamma, first=first)
        t, r = t + dt, r + dr
    return t / r if r else math.nan


# ----------------------------------------------------------------------------- bootstrap


def bootstrap_indices(n: int, samples: int, seed: int) -> np.ndarray:
    """[samples, n] indices into n paired observations, drawn with replacement: row r is the
    r-th resample. Every side of a pair is indexed by the same row, so pairs stay together."""
    if n == 0:
        raise ValueError("no paired samples to bootstrap")
    return np.random.default_rng(seed).integers(0, n, size=(samples, n))


def percentile_interval(values, confidence: float) -> list[float]:
    """[lower, upper]: the two-sided percentile interval of the bootstrap statistics `values`
    at `confidence`; NaN statistics (an empty denominator) are dropped, [nan, nan] if all are."""
    values = np.asarray(values, dtype=np.float64)
    values = values[~np.isnan(values)]
    if not values.size:
        return [math.nan, math.nan]
    tail = (1 - confidence) / 2
    return [float(np.quantile(values, tail)), float(np.quantile(values, 1 - tail))]
