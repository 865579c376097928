"""The drift gate: does the drop of α fail a deploy? (`specdistill drift --fail-if-drop-above`)

A deployment serves one or more temperatures. For each, eval/drift.py measures the draft's α
against the target before and after a fine-tune on the same prompts (α at that temperature;
α at T = 0 is argmax agreement). The gate judges the drop's *lower* confidence bound, so it
fails only when the drop is known to exceed the threshold, not when it merely might:

- per temperature: fail when the lower bound of the drop at any served temperature lies above
  the threshold (a greedy deployment can lose acceptance while T = 1 gains);
- with a temperature mixture (the share of traffic at each temperature, `--temperature-mix
  0:0.2,1:0.8`): fail when the lower bound of the mixture's drop, Σ w_T · drop_T, lies above
  it. Its interval is a paired bootstrap over prompts drawn once for all temperatures (each
  prompt's responses at every temperature stay together), so the temperatures' correlation
  is kept.

The same checks judge the relative drop of predicted τ at one γ (`--fail-if-tau-drop-above
0.02 --tau-gamma 5`): 1 − τ_after / τ_before, τ from α at each draft depth as the report's
τ table computes it (docs/theory.md §1: the i.i.d. formula for one depth, the chain of
per-depth α for an EAGLE-3 head), with its interval from the same bootstrap draws. A fine-tune
is judged by what it costs in tokens per round, whatever α it starts from.

`GateReport` is DIR/gate.json's schema.
"""

import math
from collections.abc import Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict

from specdistill.eval.stats import bootstrap_indices, percentile_interval

__all__ = ["GateCheck", "GateReport", "judge", "markdown", "parse_mix"]


class GateCheck(BaseModel):
    """One judged quantity: the drop of α at one temperature, or of the mixture."""

    model_config = ConfigDict(extra="forbid")

    name: str  # "T=0", "T=1", "mixture"
    alpha_before: float
    alpha_after: float
    drop: float
    drop_ci: list[float]
    tau_before: float  # predicted τ at tau_gamma (mixture: share-weighted)
    tau_after: float
    tau_drop: float  # 1 − τ_after / τ_before (mixture: Σ w_T · tau_drop_T)
    tau_drop_ci: list[float]
    failed: bool | None  # None: no threshold given


class GateReport(BaseModel):
    """DIR/gate.json: every check, which ones the gate judged, and the outcome."""

    model_config = ConfigDict(extra="forbid")

    threshold: float | None
    tau_threshold: float | None
    tau_gamma: int
    confidence: float
    judged: str  # "each temperature" or "mixture"
    weights: dict[str, float] | None
    checks: list[GateCheck]
    failed: bool
    reason: str


def parse_mix(text: str) -> dict[float, float]:
    """ "0:0.2,1:0.8" -> {0.0: 0.2, 1.0: 0.8}, normalised to sum 1; ValueError naming the
    problem otherwise (finite temperatures >= 0, finite weights > 0 whose sum is finite, no
    repeats: an overflowing weight, 1e400 or two of 1e308, would make the mixture NaN)."""
    mix: dict[float, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        t, sep, w = part.partition(":")
        try:
            temperature, weight = float(t), float(w)
        except ValueError:
            temperature = weight = math.nan
        if not sep or not (0 <= temperature < math.inf and 0 < weight < math.inf):
            raise ValueError(
                f"needs T:W pairs with T a finite number >= 0 and W a finite positive number; "
                f"got {part!r}"
            )
        if temperature in mix:
            raise ValueError(f"temperature {temperature:g} given twice")
        mix[temperature] = weight
    total = sum(mix.values())
    if not mix or not math.isfinite(total):
        raise ValueError(
            f"needs at least one T:W pair, the weights' sum a finite number; got {text!r}"
        )
    return {t: w / total for t, w in mix.items()}


def _ratio(x: np.ndarray) -> np.ndarray:
    """Σ α / Σ n over the prompts of [..., N, D, 2] per depth: [..., D] (NaN where n is 0)."""
    num, den = x[..., 0].sum(-2), x[..., 1].sum(-2)
    return np.divide(num, den, out=np.full_like(num, np.nan, dtype=float), where=den > 0)


def tau(per_depth: np.ndarray, gamma: int) -> np.ndarray:
    """Predicted τ at `gamma` from α per depth [..., D]: 1 + Σ_{j≤γ} Π_{i≤j} α_i, depths
    past the last reusing it (one depth: the i.i.d. formula), as eval/stats.py's tau_chain."""
    alphas = np.clip(per_depth, 0.0, 1.0)
    run, total = np.ones(alphas.shape[:-1]), np.ones(alphas.shape[:-1])
    for i in range(gamma):
        run = run * alphas[..., min(i, alphas.shape[-1] - 1)]
        total = total + run
    return total


def _depths(x) -> np.ndarray:
    """[N, 2] (one depth) or [N, D, 2] as [N, D, 2] floats."""
    x = np.asarray(x, float)
    return x[:, None, :] if x.ndim == 2 else x


def judge(
    pairs: Mapping[float, tuple[np.ndarray, np.ndarray]],
    *,
    threshold: float | None,
    tau_threshold: float | None = None,
    tau_gamma: int = 5,
    weights: Mapping[float, float] | None = None,
    samples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> GateReport:
    """The gate's report from each temperature's per-prompt (before, after) arrays, [N, 2]
    or [N, D, 2] for D draft depths (Σ α at that temperature, n positions), the same N
    prompts in the same order. α is judged at the first depth; τ from every depth.

    `weights` (temperature -> share, summing to 1, one per temperature in `pairs`): judge the
    mixture; else judge every temperature. `threshold` (α drop) and `tau_threshold` (relative
    τ drop at `tau_gamma`) None: that rule reports only, never fails.
    """
    if tau_gamma < 1:
        raise ValueError(f"tau_gamma must be >= 1; got {tau_gamma}")
    temperatures = sorted(pairs)
    sizes = {_depths(pairs[t][0]).shape[0] for t in temperatures}
    if len(sizes) != 1:
        raise ValueError("every temperature needs the same prompts")
    if weights is not None and set(weights) != set(temperatures):
        raise ValueError("the mixture's temperatures must be the measured ones")
    if weights is not None and not all(0 <= w <= 1 for w in weights.values()):
        raise ValueError(f"the mixture's weights must be finite shares in [0, 1]; got {weights}")
    idx = bootstrap_indices(sizes.pop(), samples, seed)
    rules = _Rules(threshold, tau_threshold, confidence)
    checks, boots, points = [], {}, {}
    for t in temperatures:
        before, after = (_depths(x) for x in pairs[t])
        b, a = _ratio(before), _ratio(after)
        bb, ba = _ratio(before[idx]), _ratio(after[idx])
        points[t] = (b[0], a[0], tau(b, tau_gamma), tau(a, tau_gamma))
        boots[t] = (bb[:, 0] - ba[:, 0], 1 - tau(ba, tau_gamma) / tau(bb, tau_gamma))
        checks.append(rules.check(f"T={t:g}", points[t], boots[t]))
    if weights is not None:
        point = tuple(sum(weights[t] * points[t][k] for t in temperatures) for k in range(4))
        boot = tuple(sum(weights[t] * boots[t][k] for t in temperatures) for k in range(2))
        tau_drop = sum(weights[t] * (1 - points[t][3] / points[t][2]) for t in temperatures)
        checks.append(rules.check("mixture", point, boot, tau_drop=tau_drop))
        judged = [checks[-1]]
    else:
        judged = checks
    return GateReport(
        threshold=threshold,
        tau_threshold=tau_threshold,
        tau_gamma=tau_gamma,
        confidence=confidence,
        judged="mixture" if weights is not None else "each temperature",
        weights=None if weights is None else {f"{t:g}": weights[t] for t in temperatures},
        checks=checks,
        failed=any(c.failed for c in judged),
        reason=rules.reason(judged, tau_gamma),
    )


class _Rules:
    """The two thresholds: a check fails when the lower bound of its α drop lies above
    `alpha`, or that of its relative τ drop above `tau` (each None: not judged)."""

    def __init__(self, alpha: float | None, tau: float | None, confidence: float):
        self.alpha, self.tau, self.confidence = alpha, tau, confidence

    def check(self, name, point, boot, tau_drop=None) -> GateCheck:
        """`point`: (α before, α after, τ before, τ after); `boot`: the bootstrap α drops and
        relative τ drops; `tau_drop` the point τ drop where it is not 1 − after / before."""
        alpha_ci = percentile_interval(boot[0], self.confidence)
        tau_ci = percentile_interval(boot[1], self.confidence)
        fails = [
            limit is not None and ci[0] > limit
            for limit, ci in ((self.alpha, alpha_ci), (self.tau, tau_ci))
        ]
        judged = self.alpha is not None or self.tau is not None
        return GateCheck(
            name=name,
            alpha_before=point[0],
            alpha_after=point[1],
            drop=point[0] - point[1],
            drop_ci=alpha_ci,
            tau_before=point[2],
            tau_after=point[3],
            tau_drop=1 - point[3] / point[2] if tau_drop is None else tau_drop,
            tau_drop_ci=tau_ci,
            failed=any(fails) if judged else None,
        )

    def reason(self, judged: list[GateCheck], gamma: int) -> str:
        if self.alpha is None and self.tau is None:
            return (
                "no threshold given (--fail-if-drop-above, --fail-if-tau-drop-above): "
                "reported, not judged"
            )
        rules = [
            (self.alpha, "the drop's", lambda c: c.drop_ci[0]),
            (self.tau, f"the τ({gamma}) drop's", lambda c: c.tau_drop_ci[0]),
        ]
        failed = [
            f"{c.name}: {what} lower bound {low(c):.4f} lies above {limit}"
            for c in judged
            for limit, what, low in rules
            if limit is not None and low(c) > limit
        ]
        if failed:
            return "; ".join(failed)
        return ", ".join(
            f"{c.name}: {what} lower bound {low(c):.4f} <= {limit}"
            for c in judged
            for limit, what, low in rules
            if limit is not None
        )


def markdown(gate: GateReport) -> str:
    """The gate's table and outcome, for report.md and the console."""
    lines = [
        "## Deploy gate",
        "",
        f"| | α before | α after | drop ({gate.confidence:.0%} CI) "
        f"| τ({gate.tau_gamma}) before → after | τ drop ({gate.confidence:.0%} CI) | fails |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in gate.checks:
        fails = "n/a" if c.failed is None else ("yes" if c.failed else "no")
        lines.append(
            f"| {c.name} | {c.alpha_before:.4f} | {c.alpha_after:.4f} | {c.drop:.4f} "
            f"[{c.drop_ci[0]:.4f}, {c.drop_ci[1]:.4f}] | {c.tau_before:.3f} → "
            f"{c.tau_after:.3f} | {c.tau_drop:+.1%} [{c.tau_drop_ci[0]:+.1%}, "
            f"{c.tau_drop_ci[1]:+.1%}] | {fails} |"
        )
    outcome = "FAIL" if gate.failed else "pass"
    lines += ["", f"**Gate** ({gate.judged}): {outcome} ({gate.reason})"]
    return "\n".join(lines) + "\n"
