"""A verb's wall time quiet and beside a competing CPU-bound process, with torch's default of
one thread per core ("before") and with the threads the verb chooses ("after",
specdistill/threads.py).

    python -m benchmarks.threads_under_load -- specdistill speculate --target embedded:code-deep \\
        --draft runs/code/final --prompts benchmarks/prompts/HumanEval.jsonl.gz --num-prompts 4 \\
        --max-new-tokens 48 --gamma 3 --temperature 0 --out /tmp/threads-bench

The command after `--` runs four times, one at a time: quiet and busy, each with
`--threads <cores>` appended (torch's default count, forced) and without it (the verb
chooses). "Busy" is one `python -c "while True: pass"` process started a second before the
command and killed after it (`--competitors N` for more). An `--out` directory in the command
gets a fresh suffix per run. Printed: each run's seconds, and the busy ÷ quiet ratio of each
setting (the aim: at most 2). `--results` writes the table into its section of
benchmarks/RESULTS.md. Run it alone: anything else on the machine is a competitor too.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time

from benchmarks import results as results_md
from specdistill.threads import usable_cores

SPIN = "while True: pass"


def with_out_suffix(command: list[str], suffix: str) -> list[str]:
    """`command` with the value after `--out` suffixed (a fresh output directory per run)."""
    out = list(command)
    for i, arg in enumerate(out[:-1]):
        if arg == "--out":
            out[i + 1] = f"{out[i + 1]}-{suffix}"
    return out


def timed(command: list[str], competitors: int) -> float:
    """Seconds `command` takes beside `competitors` spinning processes (a failure stops)."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(competitors)]
    try:
        if spinners:
            time.sleep(1.0)  # the competitors are running when the command starts
        start = time.perf_counter()
        # without OMP_NUM_THREADS, which the verb would keep as a forced count
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        elapsed = time.perf_counter() - start
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-3:]
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}: " + " | ".join(tail))
    return elapsed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: python -m benchmarks.threads_under_load [options] -- COMMAND")
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--competitors", type=int, default=1, help="spinning processes")
    results_md.add_argument(parser)
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if shutil.which(command[0]) is None:
        raise SystemExit(f"{command[0]}: not found")
    cores = usable_cores()
    settings = {"before": ["--threads", str(cores)], "after": []}
    seconds: dict[tuple[str, str], float] = {}
    for name, extra in settings.items():
        for load, competitors in (("quiet", 0), ("busy", args.competitors)):
            run = with_out_suffix(command, f"{name}-{load}") + extra
            seconds[name, load] = timed(run, competitors)
            print(f"{name} ({' '.join(extra) or 'chosen'}), {load}: {seconds[name, load]:.1f} s")
    lines = [
        f"| threads | quiet s | beside {args.competitors} spinning process(es) s | ratio |",
        "|---|---|---|---|",
    ]
    for name, extra in settings.items():
        quiet, busy = seconds[name, "quiet"], seconds[name, "busy"]
        label = f"{name}: `{' '.join(extra)}`" if extra else f"{name}: chosen by the verb"
        lines.append(f"| {label} | {quiet:.1f} | {busy:.1f} | {busy / quiet:.2f}× |")
    table = "\n".join(lines)
    print(table)
    if args.results:
        body = f"On {cores} usable cores; the command:\n\n    {' '.join(command)}\n\n{table}\n"
        results_md.write(
            results_md.Section(
                "threads_under_load",
                "Threads beside a competing process",
                body,
                command=results_md.command_line(
                    ["threads_under_load", *argv], "benchmarks.threads_under_load"
                ),
                machine=results_md.machine_line(),
            )
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
