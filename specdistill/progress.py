"""Progress of long work that can be trusted: an ETA from the measured time per unit of work,
and a word when the machine is busy.

    progress = WorkProgress("building 'code-deep'", total=work_units)
    for step in ...:
        ...
        progress.advance(units_of_this_step, f"step {step + 1}/{steps}  loss {loss:.3f}")
    progress.close()

A unit of work is whatever the caller's pieces cost in proportion to (an embedded build step:
layers x tokens, so a 20-layer step counts five times a 4-layer one). The ETA is the remaining
units times the seconds per unit measured over the last `window_s` seconds of work (all of it
until that much has passed), so it follows a change of phase or of load within that window.
On a terminal this is a tqdm bar; anywhere else (a log file, a pipe) one line every
`line_every_s` seconds, the first after the first piece of work.

`machine_load()` reads the 1-minute load average against the cores this process may run on;
`Load.busy` is True when the processes wanting a core outnumber the cores by half a core or
more, which slows every multi-threaded CPU job on the machine (the ETA then follows the
measured, slower speed, and the bar says why). The embedded build (models/embedded_train.py),
`specdistill speculate` (eval/sweep.py), the target cache's build and `regenerate` use it.
A utility: the standard library and specdistill/threads.py at import (tqdm when a bar is
drawn).
"""

import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from specdistill.threads import usable_cores

BUSY_MARGIN = 0.5  # runnable processes beyond the cores before the machine counts as busy


@dataclass(frozen=True)
class Load:
    """The 1-minute load average (processes running or wanting a core) and the cores."""

    load1: float
    cores: int

    @property
    def busy(self) -> bool:
        return self.load1 >= self.cores + BUSY_MARGIN

    def free_cores(self, own: float = 0.0) -> int:
        """Whole cores that no other process wants, at least 1; `own`: this process's share
        of the load average (its own running threads), not counted as another's."""
        others = max(0.0, self.load1 - own)
        return max(1, min(self.cores, math.floor(self.cores - others + BUSY_MARGIN)))

    def describe(self) -> str:
        return f"load average {self.load1:.1f} on {self.cores} cores"


def machine_load() -> Load | None:
    """The machine's load now; None where the OS reports no load average."""
    try:
        load1 = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    return Load(load1, usable_cores())


def format_seconds(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class WorkProgress:
    """A progress display over `total` units of work (module docstring)."""

    def __init__(
        self,
        desc: str,
        total: float,
        *,
        stream: TextIO | None = None,
        bar: bool | None = None,
        line_every_s: float = 30.0,
        window_s: float = 60.0,
        load: Callable[[], Load | None] = machine_load,
        clock: Callable[[], float] = time.monotonic,
        prefix: str = "",
    ):
        if not total > 0:
            raise ValueError(f"total work must be > 0, got {total}")
        self.desc, self.total, self.prefix = desc, float(total), prefix
        self.stream = stream or sys.stderr
        self.line_every_s, self.window_s = line_every_s, window_s
        self.load, self.clock = load, clock
        self.done = 0.0
        self.start = clock()
        self.samples: deque[tuple[float, float]] = deque([(self.start, 0.0)])
        self.last_line: float | None = None
        self.busy: Load | None = None  # the load that made the machine count as busy
        self.busiest: Load | None = None  # the highest busy load seen
        self.last_load_check = -math.inf
        use_bar = self.stream.isatty() if bar is None else bar
        self.bar = None
        if use_bar:
            # lazy: a bar only on a terminal; the utilities import the standard library only
            from tqdm.auto import tqdm

            class Bar(tqdm):
                """tqdm with the status (`WorkProgress.status`) as a field of its format."""

                status = ""

                @property
                def format_dict(self):
                    return {**super().format_dict, "status": self.status}

            self.bar = Bar(
                total=self.total,
                desc=desc,
                file=self.stream,
                bar_format="{desc} {percentage:3.0f}%|{bar}| {status}",
                dynamic_ncols=True,
            )

    # ------------------------------------------------------------------ measurements
    def seconds_per_unit(self) -> float | None:
        """Measured over the last `window_s` seconds of work (all of it before then)."""
        now_t, now_done = self.samples[-1]
        old_t, old_done = self.samples[0]
        if now_done <= old_done or now_t <= old_t:
            return None
        return (now_t - old_t) / (now_done - old_done)

    def eta_s(self) -> float | None:
        """Seconds left at the measured speed; None before any work was measured."""
        rate = self.seconds_per_unit()
        return None if rate is None else rate * max(0.0, self.total - self.done)

    def elapsed_s(self) -> float:
        return self.clock() - self.start

    def _percent(self) -> str:
        return f"{100 * self.done / self.total:.0f}%"

    # ------------------------------------------------------------------ updates
    def advance(self, units: float, detail: str = "", *, keep: bool = False) -> None:
        """`units` more work done; `detail` says where (a step count, a loss). `keep`: the
        detail is a result worth keeping on screen, printed as a line of its own (above the
        bar on a terminal, at once elsewhere) rather than only shown until the next update."""
        now = self.clock()
        self.done = min(self.total, self.done + units)
        self.samples.append((now, self.done))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        self._check_load(now)
        status = self.status("" if keep else detail)
        if self.bar is not None:
            if keep:
                self.note(detail)
            self.bar.status = status
            self.bar.update(units)
        elif keep or self.last_line is None or now - self.last_line >= self.line_every_s:
            self.last_line = now
            text = (
                f"{detail}  ({self._percent()}, {status})"
                if keep
                else f"{self._percent()}  {status}"
            )
            self._line(text if keep else f"{self.desc}: {text}")

    def status(self, detail: str = "") -> str:
        """`detail`, elapsed, ETA and the busy note, as the bar and the lines show them."""
        eta = self.eta_s()
        parts = [detail] if detail else []
        parts.append(f"{format_seconds(self.elapsed_s())} elapsed")
        parts.append("ETA ?" if eta is None else f"ETA {format_seconds(eta)}")
        if self.busy is not None:
            parts.append("machine busy")
        return ", ".join(parts)

    def note(self, message: str) -> None:
        """A line of its own, printed without breaking the bar."""
        if self.bar is not None:
            self.bar.write(self.prefix + message, file=self.stream)
        else:
            self._line(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "WorkProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _line(self, message: str) -> None:
        print(self.prefix + message, file=self.stream, flush=True)

    def _check_load(self, now: float) -> None:
        """At most every 10 s: note when the machine becomes busy and when it stops being."""
        if now - self.last_load_check < 10.0:
            return
        self.last_load_check = now
        load = self.load()
        if load is None:
            return
        if load.busy and self.busy is None:
            self.note(
                f"the machine is busy ({load.describe()}): other processes compete for the "
                "CPU, so this runs slower; the ETA follows the measured speed"
            )
        elif not load.busy and self.busy is not None:
            self.note(f"the machine is no longer busy ({load.describe()})")
        self.busy = load if load.busy else None
        if load.busy and (self.busiest is None or load.load1 > self.busiest.load1):
            self.busiest = load
