"""benchmarks/soak.py's checks read what the online job writes (OUT/state/trainer_state.json):
a planted untrusted record fails "no untrusted record trained", a clean state passes, and
no state at all fails both it and "the job read every line"."""

import json

import pytest

from benchmarks.soak import POISON_SHARD, Settings, _job_read, check


def fabricate(root, trained: list[str], *, state: bool = True) -> None:
    """A soak directory: two log lines, one good record, and (with `state`) the job's state
    having read both lines and trained `trained`."""
    traffic = root / "traffic"
    traffic.mkdir(parents=True)
    (traffic / POISON_SHARD).write_text('{"poison": 1}\n')
    (traffic / "traffic-000001.jsonl").write_text(json.dumps({"id": "good-1"}) + "\n")
    out = root / "online"
    (out / "state").mkdir(parents=True)
    (out / "rejects.jsonl").write_text(json.dumps({"shard": POISON_SHARD, "offset": 0}) + "\n")
    (root / "drafts").mkdir()
    if state:
        committed = {"cursor": {"lines": 2}, "trained_ids": trained}
        (out / "state" / "trainer_state.json").write_text(json.dumps(committed))


def run_check(root, untrusted: list[str]) -> dict:
    figures = {
        "_good_ids": ["good-1"],
        "_untrusted_ids": untrusted,
        "job_read_every_line": _job_read(root),
        "good_failures": [],
        "good_requests": 1,
        "hostile_failures": [],
        "hostile_requests": 1,
        "peak_rss_clean_mb": 100.0,
        "peak_rss_hostile_mb": 100.0,
        "p95_ratio": 1.0,
    }
    return check(Settings(), root, figures, {"server": True}, {"job": 0}, {0: "poison"})


def test_a_planted_untrusted_record_fails_the_check(tmp_path):
    fabricate(tmp_path, ["good-1", "untrusted-1"])
    results = run_check(tmp_path, ["untrusted-1"])
    assert results["untrusted_trained"] == 1
    assert results["checks"]["no untrusted record trained"] is False
    assert results["checks"]["the job read every line"] is True


def test_a_clean_state_passes_every_check(tmp_path):
    fabricate(tmp_path, ["good-1"])
    results = run_check(tmp_path, ["untrusted-1"])
    assert results["untrusted_trained"] == 0 and results["trained_records"] == 1
    failed = [name for name, ok in results["checks"].items() if not ok]
    assert failed == []


@pytest.mark.parametrize("check_name", ["no untrusted record trained", "the job read every line"])
def test_no_committed_state_fails_rather_than_passes(tmp_path, check_name):
    fabricate(tmp_path, [], state=False)
    assert run_check(tmp_path, ["untrusted-1"])["checks"][check_name] is False
