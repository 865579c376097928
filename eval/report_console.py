"""The one screen `specdistill speculate` prints when it ends (eval/report.py writes the files).

Per temperature: the target alone's speed, the best γ with its speed and speedup, and one
short row of every configuration's speedup and τ; then the losslessness check (at T=0 each
speculative output must equal the target-only output token for token, up to near-ties of
the target's argmax that rounding breaks either way, eval/lossless.py), a note when the
machine was busy during the run, and where report.md (every measurement, the definitions,
the plots) is.
"""

import math
import textwrap
from pathlib import Path

from specdistill.eval.report import COLUMNS

WIDTH = 100  # columns of the notes under the table


def _fmt(x, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _gamma_label(gamma) -> str:
    return {"auto": "auto", "adaptive": "adaptive"}.get(gamma, f"γ={gamma}")


def lossless_line(configs: list[dict], n_prompts: int) -> str:
    """The losslessness check of a run: at T=0 speculative output must be the target-only
    output token for token (`greedy_check`, eval/lossless.py), up to near-ties of the target's
    argmax that the run's dtype rounds either way; a real error fails it. At T>0 only the
    distribution is the target's."""
    greedy = [(e["name"], e["greedy_check"]) for e in configs if e.get("greedy_check")]
    failed = [(n, c) for n, c in greedy if c["real_errors"]]
    tied = [(n, c) for n, c in greedy if c["near_ties"]]
    sampled = sorted({f"{e['temperature']:g}" for e in configs if e["temperature"] > 0})
    parts = []
    if failed:
        parts.append(
            "LOSSLESS CHECK FAILED at T=0, real errors in: "
            + ", ".join(f"{n} ({_counts(c)})" for n, c in failed)
            + " (a real error: the two tokens' logits, scored again in higher precision, "
            "are further apart than rounding explains; report.json's greedy_check lists "
            "every divergence, outputs.jsonl has both texts)"
        )
    elif tied:
        parts.append(
            "Lossless at T=0 up to rounding: an output that differs from the target alone's "
            "first differs at a near-tie of its argmax (both tokens within rounding of the "
            "run's dtype): " + ", ".join(f"{n} ({_counts(c)})" for n, c in tied)
        )
    elif greedy:
        parts.append(
            f"Lossless: at T=0 every output equals the target alone's, token for token "
            f"({n_prompts} prompts x {len(greedy)} configurations)"
        )
    if sampled:
        parts.append(
            f"at T={','.join(sampled)} outputs follow the target's distribution, which one "
            "run cannot check (tests/eval/test_speculative.py tests it)"
        )
    return "; ".join(parts) + "."


def _counts(check: dict) -> str:
    """A `GreedyCheck`'s exact matches and its divergences of each kind."""
    counts = [f"{check['identical']}/{check['prompts']} identical"]
    for key, one in (("real_errors", "real error"), ("near_ties", "near-tie")):
        if check[key]:
            counts.append(f"{check[key]} {one}" + ("s" if check[key] > 1 else ""))
    return ", ".join(counts)


def console_summary(result: dict, out_dir: str | Path | None = None) -> str:
    """One screen for the terminal: per temperature the target alone's speed, the best γ and
    every configuration's speedup, then the losslessness check, a busy machine, and where the
    full report is."""
    meta = result.get("meta") or {}
    s = result["settings"]
    lines = []
    if meta:
        threads = meta.get("threads")
        run = (
            f"speculate: {meta.get('target')} + {meta.get('draft')}, {meta.get('n_prompts')} "
            f"prompts x {s['max_new_tokens']} new tokens, batch size {s['batch_size']}, "
            f"{meta.get('device')} {meta.get('dtype')}, {threads} thread"
            + ("s" if threads != 1 else "")
        )
        lines += _wrap(run)
    for t, base in result["baselines"].items():
        entries = [e for e in result["configs"] if f"{e['temperature']:g}" == t]
        best = result["best_gamma"][t]
        best_entry = next((e for e in entries if e["gamma"] == best["measured"]), None)
        tau = f", τ {_fmt(best_entry['tau'])}" if best_entry else ""
        lines += [
            "",
            f"T={t}: target alone {_fmt(base['tokens_per_s'], 1)} tok/s; best γ = "
            f"{best['measured']}: {_fmt(best_entry and best_entry['tokens_per_s'], 1)} tok/s, "
            f"{_fmt(best['speedup'])}x the target alone{tau}",
        ]
        labels = [_gamma_label(e["gamma"]) for e in entries]
        widths = [max(7, len(label) + 2) for label in labels]
        row = zip(labels, widths, strict=True)
        lines.append("  " + "".ljust(9) + "".join(label.rjust(w) for label, w in row))
        for name, key in (("speedup", "speedup"), ("τ", "tau")):
            cells = "".join(_fmt(e[key]).rjust(w) for e, w in zip(entries, widths, strict=True))
            lines.append("  " + name.ljust(9) + cells)
    notes = [lossless_line(result["configs"], meta.get("n_prompts", 0))]
    if meta.get("busy_load_average") is not None:
        notes.append(
            f"The machine was busy during the run (load average up to "
            f"{meta['busy_load_average']:.1f} on {meta.get('cores')} cores): speeds are slower "
            "and noisier than on a quiet machine."
        )
    if out_dir is not None:
        notes.append(
            f"Every measurement ({len(COLUMNS)} columns), the definitions, τ predictions and "
            f"plots: {Path(out_dir) / 'report.md'}"
        )
    lines.append("")
    for note in notes:
        lines += _wrap(note)
    return "\n".join(lines)


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, break_on_hyphens=False, break_long_words=False)
