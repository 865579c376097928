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

`GateReport` is DIR/gate.json's schema.
"""

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
    failed: bool | None  # None: no threshold given


class GateReport(BaseModel):
    """DIR/gate.json: every check, which ones the gate judged, and the outcome."""

    model_config = ConfigDict(extra="forbid")

    threshold: float | None
    confidence: float
    judged: str  # "each temperature" or "mixture"
    weights: dict[str, float] | None
    checks: list[GateCheck]
    failed: bool
    reason: str


def parse_mix(text: str) -> dict[float, float]:
    """ "0:0.2,1:0.8" -> {0.0: 0.2, 1.0: 0.8}, normalised to sum 1; ValueError naming the
    problem otherwise (temperatures >= 0, weights >= 0 with a positive sum, no repeats)."""
    mix: dict[float, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        t, sep, w = part.partition(":")
        try:
            temperature, weight = float(t), float(w)
        except ValueError:
            temperature = weight = float("nan")
        if not sep or not (temperature >= 0 and weight >= 0):
            raise ValueError(f"needs T:W pairs with T >= 0 and W >= 0; got {part!r}")
        if temperature in mix:
            raise ValueError(f"temperature {temperature:g} given twice")
        mix[temperature] = weight
    total = sum(mix.values())
    if not mix or total <= 0:
        raise ValueError(f"needs at least one T:W pair with a positive weight; got {text!r}")
    return {t: w / total for t, w in mix.items()}


def _ratio(x: np.ndarray) -> np.ndarray:
    """Σ α / Σ n over the last-but-one axis of [..., N, 2] (NaN where n sums to 0)."""
    num, den = x[..., 0].sum(-1), x[..., 1].sum(-1)
    return np.divide(num, den, out=np.full_like(num, np.nan, dtype=float), where=den > 0)


def judge(
    pairs: Mapping[float, tuple[np.ndarray, np.ndarray]],
    *,
    threshold: float | None,
    weights: Mapping[float, float] | None = None,
    samples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> GateReport:
    """The gate's report from each temperature's per-prompt (before, after) arrays, [N, 2]
    each (Σ α at that temperature, n positions), the same N prompts in the same order.

    `weights` (temperature -> share, summing to 1, one per temperature in `pairs`): judge the
    mixture; else judge every temperature. `threshold` None: report only, never fail.
    """
    temperatures = sorted(pairs)
    sizes = {np.asarray(pairs[t][0]).shape[0] for t in temperatures}
    if len(sizes) != 1:
        raise ValueError("every temperature needs the same prompts")
    if weights is not None and set(weights) != set(temperatures):
        raise ValueError("the mixture's temperatures must be the measured ones")
    idx = bootstrap_indices(sizes.pop(), samples, seed)
    checks, boot_drops, points = [], {}, {}
    for t in temperatures:
        before, after = (np.asarray(x, float) for x in pairs[t])
        a_b, a_a = float(_ratio(before)), float(_ratio(after))
        boot_drops[t] = _ratio(before[idx]) - _ratio(after[idx])
        points[t] = (a_b, a_a)
        checks.append(_check(f"T={t:g}", a_b, a_a, boot_drops[t], threshold, confidence))
    if weights is not None:
        mix_b = sum(weights[t] * points[t][0] for t in temperatures)
        mix_a = sum(weights[t] * points[t][1] for t in temperatures)
        boot = sum(weights[t] * boot_drops[t] for t in temperatures)
        checks.append(_check("mixture", mix_b, mix_a, boot, threshold, confidence))
        judged = [checks[-1]]
    else:
        judged = checks
    failed = [c for c in judged if c.failed]
    if threshold is None:
        reason = "no threshold given (--fail-if-drop-above): reported, not judged"
    elif failed:
        reason = "; ".join(
            f"{c.name}: the drop's lower bound {c.drop_ci[0]:.4f} lies above {threshold}"
            for c in failed
        )
    else:
        reason = ", ".join(
            f"{c.name}: lower bound {c.drop_ci[0]:.4f} <= {threshold}" for c in judged
        )
    return GateReport(
        threshold=threshold,
        confidence=confidence,
        judged="mixture" if weights is not None else "each temperature",
        weights=None if weights is None else {f"{t:g}": weights[t] for t in temperatures},
        checks=checks,
        failed=bool(failed),
        reason=reason,
    )


def _check(name, before, after, boot, threshold, confidence) -> GateCheck:
    ci = percentile_interval(boot, confidence)
    failed = None if threshold is None else bool(ci[0] > threshold)
    return GateCheck(
        name=name,
        alpha_before=before,
        alpha_after=after,
        drop=before - after,
        drop_ci=ci,
        failed=failed,
    )


def markdown(gate: GateReport) -> str:
    """The gate's table and outcome, for report.md and the console."""
    lines = [
        "## Deploy gate",
        "",
        f"| | α before | α after | drop ({gate.confidence:.0%} CI) | fails |",
        "|---|---|---|---|---|",
    ]
    for c in gate.checks:
        fails = "n/a" if c.failed is None else ("yes" if c.failed else "no")
        lines.append(
            f"| {c.name} | {c.alpha_before:.4f} | {c.alpha_after:.4f} | {c.drop:.4f} "
            f"[{c.drop_ci[0]:.4f}, {c.drop_ci[1]:.4f}] | {fails} |"
        )
    outcome = "FAIL" if gate.failed else "pass"
    lines += ["", f"**Gate** ({gate.judged}): {outcome} ({gate.reason})"]
    return "\n".join(lines) + "\n"
