"""Measured τ of the drafts a loss study trained, on prompt sets and temperatures of your choice,
with intervals over prompts: the loss study's second half, by the engine.

    python -m benchmarks.loss_tau runs/study-2l/*/final \\
        --prompt-set heldout=runs/heldout-prompts.jsonl \\
        --prompt-set humaneval=benchmarks/prompts/HumanEval.jsonl.gz \\
        --num-prompts 16 --gamma 3 --temperature 0,1 --threads 1

`benchmarks/loss_compare.py` trains one draft per (loss, seed) into OUT/<loss>-seed<k>/ and
reports held-out α and τ on a few sequences' openings at the eval temperature. This runs
`specdistill speculate` (eval/speculative.py) on each of those drafts, for each prompt set, at
each temperature, at one γ, and prints one table: a row per loss with τ as the mean over its
seeds and, per seed, the 95% interval over prompts (eval/stats.py `tau_interval`), and the
ratio of the mean against fkl's where fkl was run. The speculate reports are kept in
DRAFT/../tau-<set>/ and a finished one is not run again (kill and rerun to resume).
Decoding speed is not read from these runs: run them alone with `--repeats` for that.
"""

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from benchmarks import results as results_md
from specdistill.eval import speculative

RUN_NAME = re.compile(r"^(?P<loss>.+)-seed(?P<seed>\d+)$")


def prompt_set(text: str) -> tuple[str, str]:
    """argparse type: NAME=PATH."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"needs NAME=PATH, got {text!r}")
    return name, path


def run_label(draft: Path) -> tuple[str, int]:
    """(loss, seed) from a loss_compare run's directory name, OUT/<loss>-seed<k>/final."""
    match = RUN_NAME.match(draft.resolve().parent.name)
    if not match:
        raise SystemExit(f"{draft}: not inside a loss_compare run directory <loss>-seed<k>/")
    return match["loss"], int(match["seed"])


def measure(draft: Path, name: str, prompts: str, args) -> dict:
    """The speculate report of `draft` on one prompt set, run unless it is already there."""
    out = draft.resolve().parent / f"tau-{name}"
    report = out / "report.json"
    if not report.exists():
        speculative.main(
            [
                "--target", args.target, "--draft", str(draft), "--prompts", prompts,
                "--num-prompts", str(args.num_prompts), "--max-new-tokens",
                str(args.max_new_tokens), "--gamma", str(args.gamma), "--temperature",
                args.temperature, "--threads", str(args.threads), "--out", str(out),
                "--overwrite",
            ]
        )  # fmt: skip
    return json.loads(report.read_text())


def cells(report: dict, gamma: int) -> dict[float, tuple[float, list[float]]]:
    """temperature → (τ, its interval over prompts) at γ, from one speculate report."""
    return {
        c["temperature"]: (c["tau"], c.get("tau_interval") or [float("nan")] * 2)
        for c in report["configs"]
        if c["gamma"] == gamma
    }


def table(results: dict, sets: list[str], temperatures: list[float]) -> str:
    """Markdown: a row per loss; per (set, T) the mean τ over seeds, then each seed's τ and
    interval; the last columns the mean's ratio against fkl's."""
    columns = [(s, t) for s in sets for t in temperatures]
    header = ["loss", "seeds"] + [f"τ {s} T = {t:g}" for s, t in columns]
    header += [f"/ fkl {s} T = {t:g}" for s, t in columns]
    means = {
        loss: {col: statistics.mean(seed[col][0] for seed in seeds.values()) for col in columns}
        for loss, seeds in results.items()
    }
    rows = []
    for loss, seeds in sorted(results.items()):
        row = [loss, ",".join(str(s) for s in sorted(seeds))]
        for col in columns:
            per_seed = "; ".join(
                f"{seeds[s][col][0]:.3f} [{seeds[s][col][1][0]:.2f}, {seeds[s][col][1][1]:.2f}]"
                for s in sorted(seeds)
            )
            row.append(f"**{means[loss][col]:.3f}** ({per_seed})")
        for col in columns:
            row.append(f"{means[loss][col] / means['fkl'][col]:.3f}" if "fkl" in means else "–")
        rows.append(row)
    return results_md.markdown_table(header, rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafts", nargs="+", type=Path, help="OUT/<loss>-seed<k>/final dirs")
    parser.add_argument("--prompt-set", type=prompt_set, action="append", required=True)
    parser.add_argument("--target", default="registry:smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--temperature", default="0,1", help="comma-separated")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    temperatures = [float(t) for t in args.temperature.split(",")]
    results: dict[str, dict[int, dict]] = {}
    for draft in args.drafts:
        loss, seed = run_label(draft)
        row = results.setdefault(loss, {}).setdefault(seed, {})
        for name, prompts in args.prompt_set:
            for temperature, cell in cells(measure(draft, name, prompts, args), args.gamma).items():
                row[(name, temperature)] = cell
    print(table(results, [name for name, _ in args.prompt_set], temperatures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
