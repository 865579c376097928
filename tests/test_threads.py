"""The thread policy (specdistill/threads.py): threads follow the cores the other processes
leave free, at start and on a long job's re-checks; a forced count is kept; the measurement
sees a real busy process."""

import subprocess
import sys

import pytest

from specdistill import threads
from specdistill.threads import CpuSample, ThreadPolicy, ThreadsError


class FakeMachine:
    """CPU samples of a machine whose other processes use `others` cores and this process
    `own` cores, on a clock that moves only when slept on or advanced."""

    def __init__(self, others: float, own: float = 0.0):
        self.others, self.own, self.t = others, own, 0.0
        self.machine_s = self.own_s = 0.0
        self.set: list[int] = []

    def advance(self, seconds: float) -> None:
        self.t += seconds
        self.machine_s += (self.others + self.own) * seconds
        self.own_s += self.own * seconds

    def sample(self) -> CpuSample:
        return CpuSample(self.machine_s, self.own_s, self.t)

    def policy(self, forced=None, **kw) -> tuple[ThreadPolicy, list[str]]:
        said: list[str] = []
        policy = ThreadPolicy(
            forced,
            cores=2,
            interval_s=10.0,
            say=said.append,
            sampler=self.sample,
            set_threads=self.set.append,
            sleep=self.advance,
            clock=lambda: self.t,
            environ=kw.pop("environ", {}),
            **kw,
        )
        return policy, said


@pytest.mark.parametrize(
    ("others", "expected"), [(0.0, 2), (0.3, 2), (0.6, 1), (1.0, 1), (1.9, 1), (3.0, 1)]
)
def test_start_takes_the_cores_the_others_leave(others, expected):
    machine = FakeMachine(others)
    policy, said = machine.policy()
    assert policy.start() == expected and machine.set == [expected]
    assert said == [
        f"threads: {expected} of 2 cores (other processes busy on {others:.1f}; "
        "--threads N to force)"
    ]


def test_a_long_job_follows_the_machine_and_says_each_change():
    machine = FakeMachine(others=1.0, own=1.0)
    policy, said = machine.policy()
    assert policy.start() == 1
    machine.advance(5.0)
    assert policy.recheck() is None  # within the interval: not measured
    machine.others = 0.0  # the other job ended
    machine.advance(11.0)
    assert policy.recheck() == 2 and machine.set == [1, 2]
    assert said[-1].startswith("threads: 1 -> 2 (other processes now busy on")
    machine.advance(11.0)
    assert policy.recheck() is None and len(said) == 2  # unchanged: nothing said
    machine.others = 1.2
    machine.advance(11.0)
    assert policy.recheck() == 1 and machine.set == [1, 2, 1]


def test_own_threads_do_not_count_as_another_process():
    machine = FakeMachine(others=0.0, own=2.0)  # this process alone, on both cores
    policy, _ = machine.policy()
    policy.start()
    machine.advance(11.0)
    assert policy.recheck() is None and policy.threads == 2


def test_a_forced_count_is_kept_and_a_bad_one_refused():
    machine = FakeMachine(others=1.5)
    policy, said = machine.policy(3, name="train.threads")
    assert policy.start() == 3 and said == ["threads: 3 (train.threads)"]
    keyed, said = FakeMachine(others=0.0).policy(name="train.threads")
    keyed.start()
    assert said[0].endswith("train.threads=N to force)")
    machine.advance(100.0)
    assert policy.recheck() is None and machine.set == [3]
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ThreadsError, match=r"--threads must be an integer in \[1, "):
            ThreadPolicy(bad)


@pytest.mark.parametrize(("value", "forced"), [("1", 1), (" 3 ", 3), ("0", None), ("x", None)])
def test_omp_num_threads_in_the_environment_is_a_forced_count(value, forced):
    """A user's OMP_NUM_THREADS=N is kept as if forced (torch would take it); a value torch
    would not take is ignored and the cores are measured."""
    policy, said = FakeMachine(others=0.0).policy(environ={"OMP_NUM_THREADS": value})
    chosen = policy.start()
    if forced is None:
        assert chosen == 2 and said[0].startswith("threads: 2 of 2 cores")
    else:
        assert chosen == forced and said == [f"threads: {forced} (OMP_NUM_THREADS)"]
    kept, said = FakeMachine(others=0.0).policy(2, environ={"OMP_NUM_THREADS": "1"})
    assert kept.start() == 2 and said == ["threads: 2 (--threads)"]


def test_distributed_processes_split_the_free_cores():
    policy, _ = FakeMachine(others=0.0).policy(share=2)
    assert policy.start() == 1


def test_without_proc_stat_the_load_average_stands_in(tmp_path):
    assert threads.machine_busy_seconds(str(tmp_path / "missing")) is None
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3\n")
    assert threads.machine_busy_seconds(str(stat)) == pytest.approx(
        150 / threads.os.sysconf("SC_CLK_TCK")
    )
    said, set_ = [], []
    clock = iter(range(100))
    policy = ThreadPolicy(
        cores=2,
        say=said.append,
        sampler=lambda: CpuSample(None, 0.0, float(next(clock))),
        set_threads=set_.append,
        load_average=lambda: 1.1,
        sleep=lambda s: None,
        environ={},
    )
    assert policy.start() == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_a_real_busy_process_is_seen():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        before = threads.sample()
        threads.time.sleep(1.0)
        after = threads.sample()
    finally:
        busy.kill()
        busy.wait()
    assert threads.others_busy(before, after) >= 0.5
