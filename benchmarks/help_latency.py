"""How long `specdistill <verb> --help` takes, against a baseline checkout, in the same run.

    python -m benchmarks.help_latency --baseline-python /usr/bin/python3 --repeats 5 --results

Each command runs in a fresh interpreter (`python -m specdistill <verb> --help`), the two
interpreters alternating, `--repeats` times each; the table gives the median wall time of
each, their ratio, and which model libraries each one's --help imported (`python -X
importtime`, so nothing is guessed). `--python` is the interpreter whose `specdistill` is
measured (default: this one), `--baseline-python` one whose `specdistill` is the baseline
(e.g. another checkout's virtual environment). `--results` writes the table into its
section of benchmarks/RESULTS.md (benchmarks/results.py).
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import results as results_md

COMMANDS = [
    "distill",
    "speculate",
    "drift",
    "export",
    "cache",
    "regenerate",
    "online",
    "online rollback",
    "online demo",
    "serve",
    "convert-traffic",
]
HEAVY = ("torch", "transformers", "numpy")
NOTE = """Each `--help` in a fresh interpreter, the baseline (`--baseline-python`'s
`specdistill`) and this checkout alternating, median of the repeats; "imports": the model
libraries each one's `--help` loaded (`python -X importtime`). On a shared machine the seconds
move with the load; the ratios (both sides measured in the same run, interleaved) and the
imports are the result."""


def run(python: str, command: str) -> tuple[float, set[str]]:
    """Wall seconds of one `--help` and the heavy top-level modules it imported."""
    argv = [python, "-X", "importtime", "-m", "specdistill", *command.split(), "--help"]
    start = time.perf_counter()
    # not in a checkout: `-m` puts the working directory first on sys.path
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, cwd=tempfile.gettempdir()
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:")
    }
    return seconds, {m for m in HEAVY if m in imported}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="the measured interpreter")
    parser.add_argument("--baseline-python", required=True, help="the baseline's interpreter")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each, alternating")
    parser.add_argument(
        "--commands", default=",".join(COMMANDS), help="comma-separated (default: every verb)"
    )
    results_md.add_argument(parser)
    args = parser.parse_args(argv)
    header = ["command", "baseline s", "this s", "ratio", "baseline imports", "this imports"]
    rows = []
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for command in args.commands.split(","):
        times: dict[str, list[float]] = {"base": [], "this": []}
        loaded: dict[str, set[str]] = {"base": set(), "this": set()}
        for _ in range(args.repeats):
            for side, python in (("base", args.baseline_python), ("this", args.python)):
                seconds, heavy = run(python, command)
                times[side].append(seconds)
                loaded[side] |= heavy
        base, this = statistics.median(times["base"]), statistics.median(times["this"])
        rows.append(
            [
                f"`{command} --help`",
                f"{base:.2f}",
                f"{this:.2f}",
                f"{base / this:.1f}×",
                ", ".join(sorted(loaded["base"])) or "–",
                ", ".join(sorted(loaded["this"])) or "–",
            ]
        )
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
    if args.results:
        body = f"{NOTE}\n\n{results_md.markdown_table(header, rows)}\n"
        section = results_md.Section("help_latency", "`specdistill <verb> --help` latency", body)
        print(f"wrote {results_md.write(section, args.results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
