"""Intra-op CPU threads chosen for the machine as it is, not as torch assumes it is.

torch's default is one intra-op thread per core. Beside another CPU-bound process that
collapses: every parallel region waits for the thread that shares its core with the other
process, so on 2 cores a forward beside one busy process took 7× longer with 2 threads than
with 1 (benchmarks/RESULTS.md, "Threads"). So a verb takes as many threads as there are free
cores when it starts, and a long job re-checks between pieces of work (`ThreadPolicy.recheck`:
the trainer between steps, the embedded build, the server's worker). `--threads N` (a recipe:
`train.threads`) forces N, and so does `OMP_NUM_THREADS=N` in the environment when no count is
given; the choice is said once, and again only when it changes.

Free cores are measured, not guessed from the load average (which counts this process's own
threads and lags a minute): over an interval, the machine's busy CPU time (/proc/stat) less
this process's own CPU time (`os.times`) is what the other processes used. A core counts as
taken when the others used at least half of it. Where /proc/stat cannot be read (not Linux),
the 1-minute load average stands in for the others' use. The standard library and
specdistill/errors.py only at import.
"""

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from specdistill.bounds import THREADS_PER_CORE, max_threads
from specdistill.errors import UserError

START_SAMPLE_S = 0.3  # the interval measured before the first choice
RECHECK_S = 30.0  # a long job's re-check interval
TAKEN = 0.5  # the share of a core the others must use for it to count as taken


class ThreadsError(UserError):
    """A forced thread count that is not a positive integer."""


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class CpuSample:
    """CPU time so far: the whole machine's busy seconds (None: unknown), this process's own
    seconds, and when (monotonic seconds)."""

    machine_busy: float | None
    own: float
    at: float


def machine_busy_seconds(path: str = "/proc/stat") -> float | None:
    """Seconds every CPU has spent not idle since boot (None where /proc/stat is missing)."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def sample(clock: Callable[[], float] = time.monotonic) -> CpuSample:
    t = os.times()
    return CpuSample(machine_busy_seconds(), t.user + t.system, clock())


def others_busy(before: CpuSample, after: CpuSample) -> float | None:
    """Cores the other processes kept busy between two samples (None: not measurable)."""
    elapsed = after.at - before.at
    if before.machine_busy is None or after.machine_busy is None or elapsed <= 0:
        return None
    machine = (after.machine_busy - before.machine_busy) / elapsed
    own = (after.own - before.own) / elapsed
    return max(0.0, machine - own)


def threads_for(others: float, cores: int) -> int:
    """Threads for `cores` usable cores when the others keep `others` of them busy: the cores
    they leave free (a core is taken when they use `TAKEN` of it), at least 1."""
    taken = math.floor(others + 1.0 - TAKEN)
    return max(1, min(cores, cores - taken))


def checked_threads(threads: int | None, name: str = "--threads") -> int | None:
    """A forced thread count: None (choose) or an integer in [1, `max_threads()`]."""
    if threads is None:
        return None
    high = max_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= high:
        shown = f"{threads:.3g}" if isinstance(threads, int) and threads > 10**15 else repr(threads)
        raise ThreadsError(
            f"{name} must be an integer in [1, {high}] ({THREADS_PER_CORE} per core; or unset: "
            f"chosen), got {shown}"
        )
    return threads


def from_environment(environ, name: str) -> tuple[int | None, str]:
    """(`OMP_NUM_THREADS` as a forced count, its name) when the environment sets it to an
    integer ≥ 1 (what torch itself would take), else (None, `name`)."""
    text = environ.get("OMP_NUM_THREADS", "").strip()
    if text.isdigit() and int(text) >= 1:
        return int(text), "OMP_NUM_THREADS"
    return None, name


def check_environment(environ=None) -> None:
    """ThreadsError when `OMP_NUM_THREADS` asks for more threads than `max_threads()`: run
    before torch loads, since its OpenMP runtime reads the variable as it starts and tries
    to allocate that many threads' stacks."""
    environ = os.environ if environ is None else environ
    forced, name = from_environment(environ, "OMP_NUM_THREADS")
    if forced is not None:
        checked_threads(forced, name)


class ThreadPolicy:
    """The intra-op threads of one process (module docstring). `start()` chooses and sets
    them; `recheck()` re-measures at most every `interval_s` and sets a new count when the
    free cores changed. `share`: the processes of a distributed run on this machine, which
    split the free cores."""

    def __init__(
        self,
        forced: int | None = None,
        *,
        name: str = "--threads",
        share: int = 1,
        interval_s: float = RECHECK_S,
        say: Callable[[str], None] = print,
        cores: int | None = None,
        sampler: Callable[[], CpuSample] = sample,
        set_threads: Callable[[int], None] | None = None,
        load_average: Callable[[], float] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        environ: dict[str, str] | None = None,
    ):
        if forced is None:
            forced, name = from_environment(environ if environ is not None else os.environ, name)
        self.forced = checked_threads(forced, name)
        self.name, self.share, self.interval_s, self.say = name, max(1, share), interval_s, say
        self.cores = cores or usable_cores()
        self.sampler, self.sleep, self.clock = sampler, sleep, clock
        self.set_threads = set_threads or _torch_set_threads
        self.load_average = load_average or (lambda: os.getloadavg()[0])
        self.threads: int | None = None
        self.last: CpuSample | None = None

    def start(self) -> int:
        """Choose, set and say the thread count; -> it."""
        if self.forced is not None:
            self._set(self.forced)
            self.say(f"threads: {self.forced} ({self.name})")
            return self.forced
        before = self.sampler()
        self.sleep(START_SAMPLE_S)
        self.last = self.sampler()
        others = self._others(before, self.last)
        threads = self._choose(others)
        self._set(threads)
        self.say(
            f"threads: {threads} of {self.cores} cores (other processes busy on "
            f"{others:.1f}; {self.name}{' ' if self.name.startswith('-') else '='}N to force)"
        )
        return threads

    def recheck(self, say: Callable[[str], None] | None = None) -> int | None:
        """Re-measure when `interval_s` has passed since the last measurement; -> the new
        count when it changed (said, by `say` when given: a progress bar's line), else None."""
        if self.forced is not None or self.last is None:
            return None
        if self.clock() - self.last.at < self.interval_s:  # cheap: no sample taken
            return None
        now = self.sampler()
        others = self._others(self.last, now)
        self.last = now
        threads = self._choose(others)
        if threads == self.threads:
            return None
        previous = self.threads
        self._set(threads)
        (say or self.say)(
            f"threads: {previous} -> {threads} (other processes now busy on {others:.1f})"
        )
        return threads

    def _others(self, before: CpuSample, after: CpuSample) -> float:
        measured = others_busy(before, after)
        if measured is not None:
            return measured
        try:  # the load average counts this process's running threads too
            return max(0.0, self.load_average() - (self.threads or 0))
        except (AttributeError, OSError):
            return 0.0

    def _choose(self, others: float) -> int:
        return max(1, threads_for(others, self.cores) // self.share)

    def _set(self, threads: int) -> None:
        self.threads = threads
        self.set_threads(threads)


def _torch_set_threads(threads: int) -> None:
    import torch  # lazy: the verbs' parsers import this module; --help loads no torch

    torch.set_num_threads(threads)


HELP = "torch intra-op CPU threads, >= 1 (default: the cores free when it starts)"


def count(text: str) -> int:
    """argparse type of `--threads`: an integer >= 1 (a usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"needs an integer >= 1; got {text!r}")
    if value > max_threads():
        raise argparse.ArgumentTypeError(
            f"needs an integer in [1, {max_threads()}] ({THREADS_PER_CORE} per core); got {text!r}"
        )
    return value


def add_argument(parser, help: str = HELP) -> None:
    """A verb's `--threads` option, checked as it is parsed (None: chosen by `ThreadPolicy`)."""
    parser.add_argument("--threads", type=count, default=None, help=help)


def start(
    threads: int | None, say: Callable[[str], None] | None = None, name: str = "--threads"
) -> ThreadPolicy:
    """A started `ThreadPolicy` for a verb's `--threads` (or the key `name`), said on stderr
    (or by `say`)."""
    policy = ThreadPolicy(
        threads, name=name, say=say or (lambda line: print(line, file=sys.stderr))
    )
    policy.start()
    return policy
