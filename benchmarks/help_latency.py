"""How long `specdistill <verb> --help` takes, against a baseline checkout, in the same run.

    python -m benchmarks.help_latency --baseline-python /usr/bin/python3 --repeats 5

Each command runs in a fresh interpreter (`python -m specdistill <verb> --help`), the two
interpreters alternating, `--repeats` times each; the table gives the median wall time of
each, their ratio, and which model libraries each one's --help imported (`python -X
importtime`, so nothing is guessed). `--python` is the interpreter whose `specdistill` is
measured (default: this one), `--baseline-python` one whose `specdistill` is the baseline
(e.g. another checkout's virtual environment).
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

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
    args = parser.parse_args(argv)
    print("| command | baseline s | this s | ratio | baseline imports | this imports |")
    print("|---|---|---|---|---|---|")
    for command in args.commands.split(","):
        times: dict[str, list[float]] = {"base": [], "this": []}
        loaded: dict[str, set[str]] = {"base": set(), "this": set()}
        for _ in range(args.repeats):
            for side, python in (("base", args.baseline_python), ("this", args.python)):
                seconds, heavy = run(python, command)
                times[side].append(seconds)
                loaded[side] |= heavy
        base, this = statistics.median(times["base"]), statistics.median(times["this"])
        print(
            f"| `{command} --help` | {base:.2f} | {this:.2f} | {base / this:.1f}× | "
            f"{', '.join(sorted(loaded['base'])) or '–'} | "
            f"{', '.join(sorted(loaded['this'])) or '–'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
