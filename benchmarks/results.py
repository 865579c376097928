"""benchmarks/RESULTS.md, written by the benchmarks themselves.

Each benchmark owns one section of RESULTS.md, fenced by HTML comments that name it:

    <!-- results:vs_hf_assisted -->
    ## Against transformers' assisted generation (2026-12-02)
    ...the command, the machine, the table...
    <!-- /results:vs_hf_assisted -->

A benchmark run with `--results` replaces its own section (or appends it when there is none
yet), so a re-run updates the numbers and the README and docs link to the section instead of
repeating them. Sections a person wrote by hand (no fence) are left alone.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


@dataclass(frozen=True)
class Section:
    """One benchmark's section: `key` names its fence, `title` its header (the date is added),
    `body` is Markdown (tables, notes); the command and the machine are added above it."""

    key: str
    title: str
    body: str
    command: str | None = None
    machine: str | None = None
    date: str | None = None

    def render(self) -> str:
        date = self.date or datetime.date.today().isoformat()
        command = self.command or command_line()
        machine = self.machine or machine_line()
        return (
            f"<!-- results:{self.key} -->\n## {self.title} ({date})\n\n"
            f"```bash\n{command}\n```\n\nRan on: {machine}.\n\n{self.body.strip()}\n"
            f"<!-- /results:{self.key} -->\n"
        )


def command_line(argv: list[str] | None = None, module: str | None = None) -> str:
    """The command that reproduces this run, as a user would type it from the repository root:
    `python -m benchmarks.<name> <args>`."""
    argv = list(sys.argv if argv is None else argv)
    if module is None:
        stem = Path(argv[0]).stem if argv else "benchmark"
        module = f"benchmarks.{stem}"
    return " ".join(["python", "-m", module, *map(shlex.quote, argv[1:])])


def machine_line() -> str:
    """Where this ran: CPU model and cores (or the GPU), load, torch version."""
    parts = [f"{_cpu_model()}, {os.cpu_count()} cores visible"]
    try:
        import torch

        if torch.cuda.is_available():
            parts.insert(0, torch.cuda.get_device_name(0))
        else:
            parts.append(f"no GPU, {torch.get_num_threads()} torch thread(s)")
        parts.append(f"torch {torch.__version__}")
    except ImportError:  # pragma: no cover - every benchmark imports torch
        pass
    if hasattr(os, "getloadavg"):
        parts.append(f"load average {os.getloadavg()[0]:.1f} at the end")
    return "; ".join(parts)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


_FENCE = "<!-- results:{key} -->"
_END = "<!-- /results:{key} -->"


def write(section: Section, path: Path | str = RESULTS) -> Path:
    """Replace `section`'s fenced block in `path`, or append it; other text is kept as is."""
    path = Path(path)
    text = path.read_text() if path.exists() else "# Results\n"
    start, end = _FENCE.format(key=section.key), _END.format(key=section.key)
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end) + r"\n?", re.DOTALL)
    block = section.render()
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + block
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def _markdown_path(text: str) -> str:
    if not text.endswith(".md"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a .md file (a recipe override? put overrides before --results)"
        )
    return text


def add_argument(parser: argparse.ArgumentParser) -> None:
    """`--results [PATH]`: write this run's section into PATH (default benchmarks/RESULTS.md).
    PATH must end in .md, so that `--results key=value` does not take a recipe override for it."""
    parser.add_argument(
        "--results",
        nargs="?",
        const=str(RESULTS),
        default=None,
        type=_markdown_path,
        metavar="PATH",
        help="replace (or append) this benchmark's section of RESULTS.md "
        "(default path: benchmarks/RESULTS.md)",
    )


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    """A Markdown table; floats as they were formatted by the caller (pass strings)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
