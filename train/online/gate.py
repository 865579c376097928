"""The promotion gate: per-sequence α of candidate and incumbent on the held-out newest
traffic, a paired bootstrap interval of Δα, and a per-category regression check.

α of one sequence is the mean over its completion positions of Σ_x min(p(x), q(x)) at the
temperature the request was served at (0: greedy agreement), teacher-forced along the
completion the target produced (docs/theory.md §1). Δα = mean over held-out sequences of
(α_candidate − α_incumbent); the interval is the percentile bootstrap of that mean, pairs
resampled together (both drafts are scored on the very same sequences).
"""

from collections import defaultdict

import numpy as np
import torch

from specdistill import losses
from specdistill.data.dataset import collate
from specdistill.eval.stats import bootstrap_indices, percentile_interval
from specdistill.train.online.kept import KeptRecord


@torch.no_grad()
def sequence_alpha(
    kind, target, draft, items: list[KeptRecord], pad_token_id: int, *, batch: int = 8
):
    """α per item (mean over its completion positions) at each item's temperature."""
    device = next(target.parameters()).device
    # An EAGLE-3 head maps its V_d logits with its own d2t (the incumbent is another version).
    d2t = draft.d2t if kind.d2t is not None else None
    was_training = draft.training
    draft.eval()
    out = np.zeros(len(items))
    by_temp = defaultdict(list)
    for i, it in enumerate(items):
        by_temp[it.temperature].append(i)
    for temperature, idx in by_temp.items():
        for start in range(0, len(idx), batch):
            chunk = idx[start : start + batch]
            seqs = []
            for i in chunk:
                t = items[i].tokens()
                seqs.append(
                    {
                        "input_ids": torch.from_numpy(t.ids).long(),
                        "loss_mask": torch.from_numpy(t.mask),
                    }
                )
            b = {k: v.to(device) for k, v in collate(seqs, pad_token_id).items()}
            d_logits, t_logits, masks = kind.depths(draft, target, b)
            alpha = losses.acceptance(
                d_logits[0], t_logits[0], temperature, masks[0], d2t=d2t
            ).double()
            per = alpha.sum(-1) / masks[0].sum(-1).clamp_min(1)
            out[chunk] = per.cpu().numpy()
    if was_training:
        draft.train()
    return out


def by_temperature(cand, inc, temperatures) -> dict:
    """{temperature: {"n", "alpha_candidate", "alpha_incumbent"}} over the held-out slice.
    Greedy requests (0) score argmax agreement, which a loss at temperature 1 does not train:
    on a pair whose target is nearly flat, a refresh can raise α at 1 and lose it at 0
    (docs/online.md, "Which settings suit which pair")."""
    groups = defaultdict(list)
    for i, t in enumerate(temperatures):
        groups[f"{float(t):g}"].append(i)
    cand, inc = np.asarray(cand, dtype=np.float64), np.asarray(inc, dtype=np.float64)
    return {
        t: {
            "n": len(idx),
            "alpha_candidate": float(cand[idx].mean()),
            "alpha_incumbent": float(inc[idx].mean()),
        }
        for t, idx in sorted(groups.items(), key=lambda kv: float(kv[0]))
    }


def mean_difference_interval(
    delta, *, samples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, lower, upper): percentile bootstrap interval of mean(delta) at `confidence`, the
    pairs resampled by `eval.stats.bootstrap_indices`."""
    delta = np.asarray(delta, dtype=np.float64)
    means = delta[bootstrap_indices(len(delta), samples, seed)].mean(axis=1)
    lower, upper = percentile_interval(means, confidence)
    return float(delta.mean()), lower, upper


def unscored_why(cand: np.ndarray, inc: np.ndarray) -> str | None:
    """Why the held-out α cannot be compared (a NaN or an infinity in either draft's
    per-sequence α), or None. Such a score is never a reason to promote."""
    for name, alpha in (("candidate", cand), ("incumbent", inc)):
        bad = int((~np.isfinite(alpha)).sum())
        if bad:
            return f"the {name}'s alpha is not finite on {bad} of {len(alpha)} held-out sequences"
    return None


def decide(cand, inc, categories, cfg, *, seed: int = 0) -> dict:
    """The gate's verdict on per-sequence α arrays of candidate and incumbent.

    `cfg`: the recipe's online section (min_gain, confidence, bootstrap_samples,
    min_category_samples, max_regression, min_holdout). A non-finite α of either draft on
    any held-out sequence is a rejection (`unscored_why`)."""
    cand, inc = np.asarray(cand, dtype=np.float64), np.asarray(inc, dtype=np.float64)
    n = len(cand)
    result = {"n_heldout": n, "alpha_candidate": None, "alpha_incumbent": None}
    if n < cfg.min_holdout:
        return {
            **result,
            "promote": False,
            "why": f"held-out slice has {n} < min_holdout {cfg.min_holdout} sequences",
        }
    unscored = unscored_why(cand, inc)
    if unscored:
        return {**result, "promote": False, "why": unscored}
    delta = cand - inc
    mean, lower, upper = mean_difference_interval(
        delta, samples=cfg.bootstrap_samples, confidence=cfg.confidence, seed=seed
    )
    per_cat = {}
    groups = defaultdict(list)
    for i, c in enumerate(categories):
        groups[c if c is not None else "(none)"].append(i)
    regressed = []
    for c, idx in sorted(groups.items()):
        d = float(delta[idx].mean())
        per_cat[c] = {
            "n": len(idx),
            "alpha_candidate": float(cand[idx].mean()),
            "alpha_incumbent": float(inc[idx].mean()),
            "delta": d,
        }
        if len(idx) >= cfg.min_category_samples and d < -cfg.max_regression:
            regressed.append(c)
    result.update(
        alpha_candidate=float(cand.mean()),
        alpha_incumbent=float(inc.mean()),
        delta=mean,
        ci=[lower, upper],
        confidence=cfg.confidence,
        min_gain=cfg.min_gain,
        categories=per_cat,
    )
    if not lower > cfg.min_gain:
        why = (
            f"CI lower bound {lower:+.4f} of delta-alpha {mean:+.4f} is not above "
            f"min_gain {cfg.min_gain:g}"
        )
        return {**result, "promote": False, "why": why}
    if regressed:
        why = "categories regress by more than max_regression {:g}: {}".format(
            cfg.max_regression,
            ", ".join(f"{c} ({per_cat[c]['delta']:+.4f})" for c in regressed),
        )
        return {**result, "promote": False, "why": why}
    why = (
        f"delta-alpha {mean:+.4f}, CI [{lower:+.4f}, {upper:+.4f}] above min_gain {cfg.min_gain:g}"
    )
    return {**result, "promote": True, "why": why}
