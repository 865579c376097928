"""Progress of long work (specdistill/progress.py): the ETA from the measured time per unit of
work, the busy machine, lines in a log file and the bar on a terminal; and the embedded build's
use of it (its steps weighted by their cost)."""

import dataclasses
import io

import pytest

from specdistill import progress
from specdistill.models import embedded, embedded_train
from specdistill.progress import Load, WorkProgress, format_seconds


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def quiet() -> Load:
    return Load(0.5, 2)


def make(total, clock, stream=None, load=quiet, **kwargs) -> WorkProgress:
    return WorkProgress(
        "job", total, stream=stream or io.StringIO(), bar=False, clock=clock, load=load, **kwargs
    )


def test_eta_is_the_remaining_work_at_the_measured_seconds_per_unit():
    clock = Clock()
    p = make(100, clock)
    assert p.eta_s() is None  # nothing measured yet
    for _ in range(4):  # 4 steps of 5 units, 2 s each: 0.4 s per unit
        clock.now += 2
        p.advance(5)
    assert p.seconds_per_unit() == pytest.approx(0.4)
    assert p.eta_s() == pytest.approx(80 * 0.4)
    # Steps that cost more units take longer at the same rate: the ETA does not move.
    clock.now += 8
    p.advance(20)
    assert p.eta_s() == pytest.approx(60 * 0.4)


def test_a_step_count_would_mislead_where_units_do_not():
    """Cheap steps then dear ones (the embedded build's 4- then 20-layer phases): weighted by
    cost, the ETA after the cheap phase is the true remaining time; counting steps would
    have promised a fifth of it."""
    clock = Clock()
    steps = [1] * 10 + [5] * 10  # units per step; 1 s per unit
    p = make(sum(steps), clock)
    for units in steps[:10]:
        clock.now += units
        p.advance(units)
    assert p.eta_s() == pytest.approx(sum(steps[10:]))  # 50 s, where 10 steps took 10 s


def test_the_rate_follows_a_slowdown_within_the_window():
    clock = Clock()
    p = make(1000, clock, window_s=10)
    for _ in range(20):
        clock.now += 1
        p.advance(1)
    assert p.seconds_per_unit() == pytest.approx(1.0)
    for _ in range(20):  # the machine gets busy: 3 s per unit
        clock.now += 3
        p.advance(1)
    assert p.seconds_per_unit() == pytest.approx(3.0, rel=0.2)


def test_log_lines_come_every_line_every_s_and_kept_results_always():
    clock, stream = Clock(), io.StringIO()
    p = make(100, clock, stream=stream, line_every_s=30, prefix="[x] ")
    for _ in range(9):
        clock.now += 10
        p.advance(1, "step")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3  # at 10 s, 40 s and 70 s of the 90
    assert lines[0].startswith("[x] job: 1%  step, 10s elapsed, ETA 16m30s")
    clock.now += 1
    p.advance(1, "T=0 γ=2: 100 tok/s", keep=True)
    assert stream.getvalue().splitlines()[-1].startswith("[x] T=0 γ=2: 100 tok/s  (10%, ")


def test_a_busy_machine_is_said_once_and_its_end_too():
    clock, stream = Clock(), io.StringIO()
    loads = iter([Load(3.4, 2), Load(3.6, 2), Load(1.0, 2)])
    p = make(100, clock, stream=stream, load=lambda: next(loads), line_every_s=0)
    for _ in range(3):
        clock.now += 11  # past the 10 s between load checks
        p.advance(1, "step")
    text = stream.getvalue()
    assert text.count("the machine is busy (load average 3.4 on 2 cores)") == 1
    assert "machine busy" in text.splitlines()[1]  # the progress line after the note
    assert "no longer busy (load average 1.0 on 2 cores)" in text
    assert p.busy is None and p.busiest == Load(3.6, 2)


def test_load_thresholds():
    assert not Load(2.0, 2).busy  # a job using both cores alone
    assert Load(2.5, 2).busy
    assert Load(3.3, 2).free_cores() == 1
    assert Load(0.2, 16).free_cores() == 16
    assert Load(1.3, 2).free_cores() == 1  # another process uses more than one core
    assert Load(2.0, 2).free_cores(own=2.0) == 2  # our own threads are not another's
    assert Load(9.0, 2).free_cores() == 1


def test_machine_load_reads_the_os(monkeypatch):
    monkeypatch.setattr(progress.os, "getloadavg", lambda: (3.0, 2.0, 1.0))
    assert progress.machine_load() == Load(3.0, progress.usable_cores())

    def missing():
        raise OSError

    monkeypatch.setattr(progress.os, "getloadavg", missing)
    assert progress.machine_load() is None


def test_format_seconds():
    assert [format_seconds(s) for s in (0, 42.4, 185, 3720)] == ["0s", "42s", "3m05s", "1h02m"]


def test_the_bar_on_a_terminal_shows_the_eta_and_keeps_results_above_it():
    clock, stream = Clock(), io.StringIO()
    with WorkProgress("job", 10, stream=stream, bar=True, clock=clock, load=quiet) as p:
        clock.now += 2
        p.advance(1, "T=0 γ=1: 50 tok/s", keep=True)
        clock.now += 2
        p.advance(1, "step 2/10")
    text = stream.getvalue()
    assert "T=0 γ=1: 50 tok/s\n" in text  # written above the bar
    assert "step 2/10, 4s elapsed, ETA 16s" in text
    with pytest.raises(ValueError, match="total work must be > 0"):
        WorkProgress("job", 0, stream=stream)


def test_the_embedded_build_weights_its_steps_by_cost(tmp_path, monkeypatch, capfd):
    """A grown build's steps count layers x tokens (the head as one more layer), the total
    is their sum, and the build prints the ETA instead of a fixed time."""
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path))
    grown = dataclasses.replace(
        embedded.EMBEDDED["tiny"], num_layers=4, grow_from_layers=2, grow_at_step=12
    )
    monkeypatch.setitem(embedded.EMBEDDED, "tiny-grown", grown)
    seen = []

    class Recording(WorkProgress):
        def __init__(self, desc, total, **kwargs):
            super().__init__(desc, total, bar=False, line_every_s=0, **kwargs)
            seen.append(self)
            self.units = []

        def advance(self, units, detail="", **kwargs):
            self.units.append(units)
            super().advance(units, detail, **kwargs)

    monkeypatch.setattr(embedded_train, "WorkProgress", Recording)
    embedded.resolve_model("embedded:tiny-grown")
    (p,) = seen
    tokens = grown.batch_size * grown.seq_len
    assert p.units == [3 * tokens] * 12 + [5 * tokens] * (grown.steps - 12)
    assert p.total == sum(p.units) and p.done == p.total
    err = capfd.readouterr().err
    assert "ETA" in err and f"step {grown.steps}/{grown.steps}" in err
    assert "min on" not in err and "~" not in err  # no fixed time promised


def test_records_with_the_old_eta_field_stay_current(tmp_path, monkeypatch):
    """Builds recorded when specs still carried a display `eta` are not rebuilt."""
    import json

    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path))
    path = embedded.build("tiny-draft")
    record_file = path / embedded.BUILD_RECORD
    record = json.loads(record_file.read_text())
    record["spec"]["eta"] = "~30 s on 2 CPU cores"
    record_file.write_text(json.dumps(record))

    def fail(*args):
        raise AssertionError("rebuilt a current model")

    monkeypatch.setattr(embedded, "_train_model", fail)
    assert embedded.resolve_model("embedded:tiny-draft") == str(path)
    record["spec"]["steps"] += 1  # a real difference still counts
    record_file.write_text(json.dumps(record))
    with pytest.raises(AssertionError, match="rebuilt"):
        embedded.resolve_model("embedded:tiny-draft")
