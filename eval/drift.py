"""α drift after a target fine-tune: measure it (`measure`) and summarise it (`summarise`,
with the paired bootstrap). The command line is serve/drift_cli.py (`specdistill drift`), whose
module docstring says what each number means; eval/drift_score.py scores the prompts,
eval/drift_report.py writes the report (`DriftReport` is report.json's schema) and
eval/drift_gate.py judges the drop for a deploy.
"""

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from specdistill import drafts
from specdistill.errors import UserError
from specdistill.eval.cli_args import DEFAULT_MAX_GAMMA
from specdistill.eval.drift_report import (
    DriftReport,
    markdown,
    plot,
    response_records,
    save_responses,
    write,
)
from specdistill.eval.drift_score import PromptScore, generate_responses, score_prompt
from specdistill.eval.prompts import encode_prompts
from specdistill.eval.stats import bootstrap_indices, percentile_interval, tau_chain, tau_iid

__all__ = [
    "DriftReport",
    "PromptScore",
    "generate_responses",
    "markdown",
    "measure",
    "measure_scores",
    "paired_bootstrap",
    "per_category",
    "plot",
    "response_records",
    "save_responses",
    "score_prompt",
    "summarise",
    "write",
]

# ----------------------------------------------------------------------------- statistics


def paired_bootstrap(
    before: np.ndarray,
    after: np.ndarray,
    *,
    samples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict:
    """α before / after / drop (= before − after) with paired bootstrap intervals.

    before, after: [N, 2] per prompt (Σ α, n positions), the same prompts in the same order.
    Prompts are resampled with replacement (the same draw for both sides); α is the ratio
    of sums over the resampled prompts. Intervals are percentile intervals at `confidence`.
    """
    before, after = np.asarray(before, float), np.asarray(after, float)
    if before.shape != after.shape or before.ndim != 2 or before.shape[1] != 2:
        raise ValueError("before and after must both be [N, 2] arrays (Σ α, n) per prompt")
    n = before.shape[0]
    if n == 0:
        raise ValueError("no prompts to bootstrap")

    def ratio(x, axis=-1):
        num, den = x[..., 0].sum(axis), x[..., 1].sum(axis)
        return np.divide(num, den, out=np.full_like(num, np.nan, dtype=float), where=den > 0)

    a_b, a_a = float(ratio(before[None])[0]), float(ratio(after[None])[0])
    idx = bootstrap_indices(n, samples, seed)
    boot_b, boot_a = ratio(before[idx]), ratio(after[idx])
    return {
        "n": n,
        "before": a_b,
        "after": a_a,
        "drop": a_b - a_a,
        "before_ci": percentile_interval(boot_b, confidence),
        "after_ci": percentile_interval(boot_a, confidence),
        "drop_ci": percentile_interval(boot_b - boot_a, confidence),
    }


def per_category(
    categories: Sequence[str | None],
    before: np.ndarray,
    after: np.ndarray,
    *,
    min_samples: int = 10,
    samples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict:
    """{category: paired_bootstrap(...) | {"n": n, "insufficient": True}} per category
    (None -> "uncategorised"), cells with fewer than `min_samples` prompts insufficient."""
    groups = defaultdict(list)
    for i, c in enumerate(categories):
        groups["uncategorised" if c is None else c].append(i)
    before, after = np.asarray(before, float), np.asarray(after, float)
    out = {}
    for name in sorted(groups):
        rows = groups[name]
        if len(rows) < min_samples:
            out[name] = {"n": len(rows), "insufficient": True, "min_samples": min_samples}
            continue
        cell = paired_bootstrap(
            before[rows], after[rows], samples=samples, confidence=confidence, seed=seed
        )
        out[name] = {**cell, "insufficient": False}
    return out


def _ratio(rows: np.ndarray) -> float:
    n = rows[..., -1].sum()
    return float(rows[..., 0].sum() / n) if n > 0 else math.nan


def _taus(per_depth: Sequence[float], max_gamma: int) -> dict:
    if any(math.isnan(a) for a in per_depth):
        return {}
    if len(per_depth) == 1:
        return {g: tau_iid(min(max(per_depth[0], 0.0), 1.0), g) for g in range(1, max_gamma + 1)}
    return {g: tau_chain(per_depth, g) for g in range(1, max_gamma + 1)}


def summarise(
    scores: Sequence[PromptScore],
    *,
    token_loss: dict | None = None,
    tokenizer=None,
    threshold: float = 0.02,
    min_samples: int = 10,
    samples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    max_gamma: int = DEFAULT_MAX_GAMMA,
    top: int = 20,
) -> dict:
    """The drift report's numbers (the module docstring says what each one is)."""
    if not scores:
        raise UserError("no prompts scored")
    before = np.stack([s.before for s in scores])  # [N, K, 3]
    after = np.stack([s.after for s in scores])
    cross = np.stack([s.cross for s in scores])
    tv = np.stack([s.tv for s in scores])  # [N, 3]
    k = before.shape[1]
    pairs_t = (before[:, 0][:, [0, 2]], after[:, 0][:, [0, 2]])
    pairs_0 = (before[:, 0][:, [1, 2]], after[:, 0][:, [1, 2]])
    boot = dict(samples=samples, confidence=confidence, seed=seed)
    serving, greedy = paired_bootstrap(*pairs_t, **boot), paired_bootstrap(*pairs_0, **boot)
    depths = _depth_alphas(before, after)
    categories = [s.category for s in scores]
    cats = _categories(categories, pairs_t, pairs_0, min_samples=min_samples, boot=boot)
    n_pos = tv[:, 2].sum()
    report = {
        "alpha_before": serving["before"],
        "alpha_after": serving["after"],
        "alpha_drop": serving["drop"],
        "alpha_before_ci": serving["before_ci"],
        "alpha_after_ci": serving["after_ci"],
        "alpha_drop_ci": serving["drop_ci"],
        "alpha_greedy_before": greedy["before"],
        "alpha_greedy_after": greedy["after"],
        "alpha_greedy_drop": greedy["drop"],
        "alpha_greedy_drop_ci": greedy["drop_ci"],
        "alpha_greedy_before_ci": greedy["before_ci"],
        "alpha_greedy_after_ci": greedy["after_ci"],
        "alpha_before_on_after_text": _ratio(cross[:, 0][:, [0, 2]]),
        "alpha_greedy_before_on_after_text": _ratio(cross[:, 0][:, [1, 2]]),
        "target_tv": float(tv[:, 0].sum() / n_pos) if n_pos else math.nan,
        "target_argmax_disagreement": float(tv[:, 1].sum() / n_pos) if n_pos else math.nan,
        "tau_before": _taus(depths["alpha_before"], max_gamma),
        "tau_after": _taus(depths["alpha_after"], max_gamma),
        "tau_greedy_before": _taus(depths["alpha_greedy_before"], max_gamma),
        "tau_greedy_after": _taus(depths["alpha_greedy_after"], max_gamma),
        "per_category": cats,
        "n_prompts": len(scores),
        "n_positions_before": int(before[:, 0, 2].sum()),
        "n_positions_after": int(after[:, 0, 2].sum()),
        "verdict": _verdict(serving, threshold, confidence),
    }
    report["drop_from_text"] = report["alpha_before"] - report["alpha_before_on_after_text"]
    report["drop_from_target"] = report["alpha_before_on_after_text"] - report["alpha_after"]
    if k > 1:
        report["per_depth"] = depths
    if token_loss:
        report["top_tokens"] = _top_tokens(token_loss, tokenizer, top)
    return report


def _depth_alphas(before: np.ndarray, after: np.ndarray) -> dict[str, list[float]]:
    """α at each draft depth, at the serving temperature and greedy, before and after
    (before, after: [N, K, 3] per prompt and depth)."""
    k = before.shape[1]
    return {
        "alpha_before": [_ratio(before[:, i][:, [0, 2]]) for i in range(k)],
        "alpha_after": [_ratio(after[:, i][:, [0, 2]]) for i in range(k)],
        "alpha_greedy_before": [_ratio(before[:, i][:, [1, 2]]) for i in range(k)],
        "alpha_greedy_after": [_ratio(after[:, i][:, [1, 2]]) for i in range(k)],
    }


def _categories(categories, pairs_t, pairs_0, *, min_samples: int, boot: dict) -> dict:
    """`per_category` at the serving temperature, each sufficient cell with its greedy
    numbers under "greedy"."""
    cats = per_category(categories, *pairs_t, min_samples=min_samples, **boot)
    cats_0 = per_category(categories, *pairs_0, min_samples=min_samples, **boot)
    for name, cell in cats.items():
        if not cell["insufficient"]:
            cell["greedy"] = {
                key: cats_0[name][key]
                for key in ("before", "after", "drop", "before_ci", "after_ci", "drop_ci")
            }
    return cats


def _verdict(serving: dict, threshold: float, confidence: float) -> dict:
    """Refit when the whole interval of the serving α's drop lies above `threshold`."""
    lo, hi = serving["drop_ci"]
    refit = bool(lo > threshold)
    return {
        "refit_recommended": refit,
        "threshold": threshold,
        "drop": serving["drop"],
        "drop_ci": serving["drop_ci"],
        "reason": (
            f"the drop of α ({serving['drop']:.4f}, {confidence:.0%} interval "
            f"[{lo:.4f}, {hi:.4f}]) lies entirely above the threshold {threshold}"
            if refit
            else f"the {confidence:.0%} interval of the drop of α [{lo:.4f}, {hi:.4f}] does not "
            f"lie entirely above the threshold {threshold}"
        ),
    }


def _top_tokens(token_loss: dict, tokenizer, top: int) -> list[dict]:
    """The `top` tokens that lost the most α mass (token id -> (α lost, count))."""
    total = sum(count for _, count in token_loss.values())
    ranked = sorted(token_loss.items(), key=lambda item: -item[1][0])[:top]
    return [
        {
            "token_id": int(tok),
            "token": tokenizer.decode([tok]) if tokenizer is not None else str(tok),
            "alpha_mass_lost": loss / total,
            "count": count,
            "mean_alpha_drop": loss / count,
        }
        for tok, (loss, count) in ranked
    ]


# ----------------------------------------------------------------------------- pipeline


def measure(*args, **kwargs) -> tuple[dict, dict]:
    """(report, responses {"before": [...], "after": [...]}) for `prompts` (eval.prompts);
    the arguments are `measure_scores`'s."""
    report, responses, _ = measure_scores(*args, **kwargs)
    return report, responses


def measure_scores(
    target_before,
    target_after,
    draft,
    tokenizer,
    prompts,
    *,
    temperature: float = 1.0,
    top_p: float | None = None,
    top_k: int | None = None,
    max_new_tokens: int = 64,
    max_prompt_tokens: int = 512,
    stop_at_eos: bool = True,
    batch_size: int = 8,
    depth: int | None = None,
    seed: int = 0,
    threshold: float = 0.02,
    min_samples: int = 10,
    bootstrap: int = 1000,
    confidence: float = 0.95,
    max_gamma: int = DEFAULT_MAX_GAMMA,
) -> tuple[dict, dict, list[PromptScore]]:
    """`measure`'s (report, responses) and the per-prompt scores the report summarises (the
    drift gate bootstraps them jointly over temperatures, eval/drift_gate.py)."""
    kind = drafts.type_of(draft)
    if depth is None:
        depth = getattr(draft, "ttt_steps", None) or getattr(draft.config, "ttt_steps", 3) or 3
    vocab_size = drafts.compared_vocab_size(target_before, target_after, draft=draft)
    prompt_ids = encode_prompts(prompts, tokenizer, max_tokens=max_prompt_tokens)
    gen = dict(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id if stop_at_eos else None,
        seed=seed,
        batch_size=batch_size,
    )
    out_before = generate_responses(target_before, prompt_ids, **gen)
    out_after = generate_responses(target_after, prompt_ids, **gen)
    token_loss: dict = {}
    scores = [
        score_prompt(
            target_before,
            target_after,
            draft,
            p,
            b,
            a,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            depth=depth,
            vocab_size=vocab_size,
            category=prompt.category,
            token_loss=token_loss,
        )
        for prompt, p, b, a in zip(prompts, prompt_ids, out_before, out_after, strict=True)
    ]
    report = summarise(
        scores,
        token_loss=token_loss,
        tokenizer=tokenizer,
        threshold=threshold,
        min_samples=min_samples,
        samples=bootstrap,
        confidence=confidence,
        seed=seed,
        max_gamma=max_gamma,
    )
    report["temperature"] = temperature
    report["draft_type"] = kind.name
    return report, {"before": out_before, "after": out_after}, scores
