"""Measured τ against the i.i.d. and the round-aware predictions, from engine reports.

    python -m benchmarks.tau_table runs/tau-check/*/report.json
    python -m benchmarks.tau_table --tolerance 0.03 runs/spec/report.json

Reads the report.json files `python eval/speculative.py ... --out DIR` writes (eval/sweep.py)
and prints one markdown table, a row per (report, temperature, fixed γ): measured τ with a
rough standard error, the i.i.d. prediction (1 − α^(γ+1))/(1 − α) on the offline α
(`tau_pred`) and the round-boundary prediction training reports (`tau_pred_rounds`,
docs/theory.md §1 "Round boundaries"), each with its relative error (prediction − τ)/τ, and
whether it is within the tolerance.

rounds: the row-rounds measured τ averages over (those `acceptance_stats` counts: γ not
shortened by the length limit). SE: the standard error of τ from the per-round token counts
(rejection histogram), treating rounds as independent; rounds of one text are correlated, so
the real error is somewhat larger. z: (τ pred (rounds) − τ) / SE.
"""

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path


def tau_standard_error(entry: dict) -> float:
    """SE of measured τ from the rejection histogram, rounds taken as independent.

    A first rejection at slot i commits i tokens (i − 1 drafts + the correction); a round with
    no rejection commits γ + 1.
    """
    counts = [(i + 1, n) for i, n in enumerate(entry["rejection_histogram"])]
    counts.append((entry["gamma"] + 1, entry["no_rejection"]))
    total = sum(n for _, n in counts)
    if total < 2:
        return math.nan
    mean = sum(t * n for t, n in counts) / total
    var = sum(n * (t - mean) ** 2 for t, n in counts) / (total - 1)
    return math.sqrt(var / total)


def _rounds(entry: dict) -> int:
    return sum(entry["rejection_histogram"]) + entry["no_rejection"]


def _pct(x: float | None) -> str:
    return "–" if x is None or math.isnan(x) else f"{100 * x:+.1f}%"


def _num(x: float | None, digits: int = 3) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def _error(pred: float | None, tau: float) -> float:
    return math.nan if pred is None else (pred - tau) / tau


def rows(report_paths: Sequence[str | Path], tolerance: float) -> list[dict]:
    """One dict per (report, temperature, fixed γ), in the reports' order."""
    out = []
    for path in report_paths:
        path = Path(path)
        report = json.loads(path.read_text())
        meta = report.get("meta", {})
        for e in report["configs"]:
            if e["gamma"] == "adaptive":
                continue
            tau = e["tau"]
            se = tau_standard_error(e)
            iid_err = _error(e.get("tau_pred"), tau)
            rounds_err = _error(e.get("tau_pred_rounds"), tau)
            pred_rounds = e.get("tau_pred_rounds")
            out.append(
                {
                    "run": path.parent.name,
                    "draft": meta.get("draft", "?"),
                    "prompts": Path(meta.get("prompts", "?")).name,
                    "n_prompts": meta.get("n_prompts"),
                    "max_new_tokens": report["settings"]["max_new_tokens"],
                    "temperature": e["temperature"],
                    "gamma": e["gamma"],
                    "rounds": _rounds(e),
                    "tau": tau,
                    "tau_se": se,
                    "tau_pred_iid": e.get("tau_pred"),
                    "iid_error": iid_err,
                    "tau_pred_rounds": pred_rounds,
                    "rounds_error": rounds_err,
                    "z": math.nan if pred_rounds is None or not se else (pred_rounds - tau) / se,
                    "iid_within": abs(iid_err) <= tolerance,
                    "rounds_within": abs(rounds_err) <= tolerance,
                }
            )
    return out


def markdown(table: list[dict], tolerance: float) -> str:
    lines = [
        "| run | draft | prompts | T | γ | rounds | τ measured ± SE | τ pred (iid) | iid err "
        "| τ pred (rounds) | rounds err | z |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        flag = "" if r["rounds_within"] else " ✗"
        lines.append(
            f"| {r['run']} | `{r['draft']}` | {r['prompts']} ({r['n_prompts']}) "
            f"| {r['temperature']:g} | {r['gamma']} | {r['rounds']} "
            f"| {_num(r['tau'])} ± {_num(r['tau_se'])} | {_num(r['tau_pred_iid'])} "
            f"| {_pct(r['iid_error'])} | {_num(r['tau_pred_rounds'])} "
            f"| {_pct(r['rounds_error'])}{flag} | {_num(r['z'], 1)} |"
        )
    n = len(table)
    iid_ok = sum(r["iid_within"] for r in table)
    rounds_ok = sum(r["rounds_within"] for r in table)
    misses = [
        f"{r['run']} T={r['temperature']:g} γ={r['gamma']} ({_pct(r['rounds_error'])})"
        for r in table
        if not r["rounds_within"]
    ]
    lines += [
        "",
        f"Within ±{tolerance:.0%} of measured τ: round-aware {rounds_ok}/{n}, "
        f"i.i.d. {iid_ok}/{n}."
        + (f" Round-aware misses (✗): {', '.join(misses)}." if misses else ""),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("reports", nargs="+", help="report.json files of eval/speculative.py")
    parser.add_argument(
        "--tolerance", type=float, default=0.03, help="relative error counted as agreement"
    )
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    table = rows(args.reports, args.tolerance)
    print(markdown(table, args.tolerance))
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))
    return table


if __name__ == "__main__":
    main()
