"""benchmarks/real_drift.py's summary: the drift reports, the gates and the repair of one
fine-tune, read back from their files, as OUT/summary.json and OUT/summary.md."""

import json
import math
from pathlib import Path

TEMPERATURES = ("T0", "T1")
TAU_GAMMA = "5"


def cell(report: dict) -> dict:
    """The numbers of one drift report (one temperature) the tables show."""
    tau_b, tau_a = report["tau_before"][TAU_GAMMA], report["tau_after"][TAU_GAMMA]
    cats = {
        name: {"drop": c.get("drop"), "drop_ci": c.get("drop_ci")}
        for name, c in report["per_category"].items()
        if not c.get("insufficient")
    }
    return {
        "alpha_before": report["alpha_before"],
        "alpha_after": report["alpha_after"],
        "drop": report["alpha_drop"],
        "drop_ci": report["alpha_drop_ci"],
        "tau5_before": tau_b,
        "tau5_after": tau_a,
        "tau5_drop": (tau_b - tau_a) / tau_b,
        "drop_from_text": report["drop_from_text"],
        "drop_from_target": report["drop_from_target"],
        "target_tv": report["target_tv"],
        "per_category": cats,
        "top_tokens": [(t["token"], round(t["alpha_mass_lost"], 2)) for t in report["top_tokens"]][
            :4
        ]
        if report.get("top_tokens")
        else [],
    }


def drift_dir(path: Path) -> dict | None:
    """{T0, T1: cell, gate: {failed, reason}} of a `specdistill drift` output; None if absent."""
    if not (path / "gate.json").is_file():
        return None
    gate = json.loads((path / "gate.json").read_text())
    out = {t: cell(json.loads((path / t / "report.json").read_text())) for t in TEMPERATURES}
    for check in gate["checks"]:
        t = "T" + check["name"].removeprefix("T=")
        if t in out:
            out[t]["tau5_drop_ci"] = check.get("tau_drop_ci")
            out[t]["gate_failed"] = check["failed"]
    out["gate"] = {"failed": gate["failed"], "reason": gate["reason"]}
    return out


def recovered(old: dict, new: dict) -> float:
    """The share of the old draft's drop (before − after) the new draft's α after closes."""
    gap = old["alpha_before"] - old["alpha_after"]
    return (new["alpha_after"] - old["alpha_after"]) / gap if gap > 0 else math.nan


def repair_summary(out: Path, old: dict, repair: dict) -> dict:
    """The refit's curve as the share of the T = 1 drift gap recovered by steps, the refit's
    and the fresh draft's α after (T = 0, 1), and the fresh steps to reach the refit's α."""
    refit, fresh = drift_dir(out / "drift-refit"), drift_dir(out / "drift-fresh")
    alpha_0 = repair["alpha_drifted"]
    gap = old["T1"]["alpha_before"] - old["T1"]["alpha_after"]
    curve = [
        {"step": h["step"], "alpha": h["alpha"], "recovered": (h["alpha"] - alpha_0) / gap}
        for h in repair["refit"]["curve"]
    ]
    start = repair.get("from_start") or {}
    fresh_curve = [{"step": h["step"], "alpha": h["alpha"]} for h in start.get("curve", [])]
    final = repair["refit"]["final_alpha"]
    reach = next((h["step"] for h in fresh_curve if h["alpha"] >= final), None)
    result = {
        "refit_steps": repair["refit"]["steps"],
        "fresh_steps": start.get("steps"),
        "alpha_drifted_trainer": alpha_0,
        "curve": curve,
        "fresh_curve": fresh_curve,
        "fresh_steps_to_refit_alpha": reach,
    }
    for t in TEMPERATURES:
        if refit:
            result[f"refit_{t}"] = refit[t]["alpha_after"]
            result[f"refit_recovered_{t}"] = recovered(old[t], refit[t])
        if fresh:
            result[f"fresh_{t}"] = fresh[t]["alpha_after"]
            result[f"fresh_recovered_{t}"] = recovered(old[t], fresh[t])
    return result


def summary(out: Path, names: list[str], repair: dict | None, *, seconds: float) -> dict:
    drifts = {name: drift_dir(out / f"drift-{name}") for name in names}
    result = {
        "fine_tune": json.loads((out / "fine_tune.json").read_text())
        if (out / "fine_tune.json").is_file()
        else None,
        "drift": drifts,
        "self": drift_dir(out / "drift-self"),
        "seconds": seconds,
    }
    if repair is not None:
        result["repair"] = repair_summary(out, drifts[names[0]], repair)
    return result


def _f(x, digits=3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _ci(ci) -> str:
    return f"[{_f(ci[0])}, {_f(ci[1])}]"


def _pct(x) -> str:
    return f"{100 * x:+.1f}%"


def _pct_ci(ci) -> str:
    return "" if ci is None else f"[{_pct(ci[0])}, {_pct(ci[1])}]"


def drift_table(result: dict) -> list[str]:
    lines = [
        "| draft | T | α before | α after | drop [95% CI] | τ(5) before → after | "
        "τ drop [95% CI] | from target / text | gate |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = {**result["drift"], "self (unchanged target)": result["self"]}
    for name, d in rows.items():
        if d is None:
            continue
        for t in TEMPERATURES:
            c = d[t]
            lines.append(
                f"| {name} | {t[1:]} | {_f(c['alpha_before'])} | {_f(c['alpha_after'])} | "
                f"{_f(c['drop'])} {_ci(c['drop_ci'])} | {_f(c['tau5_before'])} → "
                f"{_f(c['tau5_after'])} | {_pct(c['tau5_drop'])} "
                f"{_pct_ci(c.get('tau5_drop_ci'))} | "
                f"{_f(c['drop_from_target'])} / {_f(c['drop_from_text'])} | "
                f"{'FAIL' if c.get('gate_failed') else 'pass'} |"
            )
    return lines


def category_table(result: dict) -> list[str]:
    lines = ["| draft | T | " + " | ".join(["write", "explain", "use"]) + " | top tokens lost |"]
    lines.append("|---|---|---|---|---|---|")
    for name, d in result["drift"].items():
        if d is None:
            continue
        for t in TEMPERATURES:
            cats = d[t]["per_category"]
            cells = [
                f"{_f(cats[k]['drop'])} {_ci(cats[k]['drop_ci'])}" if k in cats else "n/a"
                for k in ("write", "explain", "use")
            ]
            tokens = ", ".join(f"`{tok!r}` {m}" for tok, m in d[t]["top_tokens"])
            lines.append(f"| {name} | {t[1:]} | " + " | ".join(cells) + f" | {tokens} |")
    return lines


def repair_lines(r: dict) -> list[str]:
    lines = ["| refit step | α (T = 1, trainer) | share of the T = 1 gap recovered |"]
    lines.append("|---|---|---|")
    for h in r["curve"]:
        lines.append(f"| {h['step']} | {_f(h['alpha'])} | {100 * h['recovered']:.0f}% |")
    if r["fresh_curve"]:
        lines += ["", "| fresh step | α (T = 1, trainer) |", "|---|---|"]
        lines += [f"| {h['step']} | {_f(h['alpha'])} |" for h in r["fresh_curve"]]
    lines.append("")
    for t in TEMPERATURES:
        fresh = (
            f"; fresh ({r['fresh_steps']} steps) α after {_f(r.get(f'fresh_{t}'))}, "
            f"{100 * r.get(f'fresh_recovered_{t}', math.nan):.0f}%"
            if r["fresh_steps"]
            else ""
        )
        lines.append(
            f"- {t}: refit ({r['refit_steps']} steps) α after {_f(r.get(f'refit_{t}'))}, "
            f"recovered {100 * r.get(f'refit_recovered_{t}', math.nan):.0f}% of the drop{fresh}"
        )
    if r["fresh_steps"]:
        lines.append(
            f"- the fresh draft first reaches the refit's final α at step "
            f"{r['fresh_steps_to_refit_alpha'] or 'none of ' + str(r['fresh_steps'])}"
        )
    return lines


def write_summary(out: Path, result: dict) -> None:
    (out / "summary.json").write_text(json.dumps(result, indent=1, default=str))
    lines = [*drift_table(result), "", *category_table(result)]
    if "repair" in result:
        lines += ["", *repair_lines(result["repair"])]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
