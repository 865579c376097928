"""benchmarks/gpu_carry.sh and benchmarks/gpu_study.sh, on this machine: a file cut into parts
joins back to its bytes only when every part is there and sound; the study with no time left
reports every run as not reached; and (slow) the whole study, shrunk to the embedded pair on
the CPU, writes loss_compare's table for each recipe and brings back each run's eval.json."""

import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CARRY = REPO / "benchmarks" / "gpu_carry.sh"
STUDY = REPO / "benchmarks" / "gpu_study.sh"
MIX = "lk+tau:loss.name=mix;loss.parts={lk_lambda: 1.0, tau: 1.0}"


def carry(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CARRY), *map(str, args)], capture_output=True, text=True)


def test_a_file_cut_into_parts_joins_back_to_its_bytes(tmp_path):
    wheel = tmp_path / "x-1.0-py3-none-any.whl"
    data = os.urandom(2500)
    wheel.write_bytes(data)
    assert carry("--split", wheel, tmp_path / "carry", "1K").returncode == 0
    parts = sorted((tmp_path / "carry").glob("part*/*.part-*"))
    assert [p.parent.name for p in parts] == ["part1", "part2", "part3"]  # one per call
    assert [p.stat().st_size for p in parts] == [1024, 1024, 452]
    sums = (tmp_path / "carry" / "part3" / "SHA256SUMS").read_text().split()
    assert sums[-2:] == [hashlib.sha256(data).hexdigest(), wheel.name]

    device = tmp_path / "device"  # each call copies its part there
    device.mkdir()
    for folder in sorted((tmp_path / "carry").glob("part*")):
        subprocess.run(["cp", "-r", *map(str, folder.iterdir()), str(device)], check=True)
    joined = carry("--join", device)
    assert joined.returncode == 0, joined.stderr
    assert (device / "wheel" / wheel.name).read_bytes() == data


@pytest.mark.parametrize("damage", ["missing", "changed"])
def test_a_missing_or_damaged_part_joins_into_nothing(tmp_path, damage):
    wheel = tmp_path / "x.whl"
    wheel.write_bytes(os.urandom(2500))
    carry("--split", wheel, tmp_path / "carry", "1K")
    device = tmp_path / "device"
    device.mkdir()
    for folder in sorted((tmp_path / "carry").glob("part*")):
        subprocess.run(["cp", "-r", *map(str, folder.iterdir()), str(device)], check=True)
    part = device / "x.whl.part-01"
    if damage == "missing":
        part.unlink()
    else:
        part.write_bytes(b"\0" + part.read_bytes()[1:])
    joined = carry("--join", device)
    assert joined.returncode != 0 and "do not join" in joined.stderr
    assert not (device / "wheel" / "x.whl").exists()


def study(out: Path, runs: Path, **env) -> subprocess.CompletedProcess:
    """gpu_study.sh on the embedded pair, shrunk by its variables; `env` overrides them."""
    shrink = {
        "PYTHON": sys.executable,
        "TARGET": "embedded:code-deep",
        "RUNS": str(runs),
        "SPECDISTILL_CACHE": os.environ.get(
            "SPECDISTILL_CACHE", str(Path.home() / ".cache" / "specdistill")
        ),
        "LIMIT": "16",
        "EVAL_LIMIT": "8",
        "MAX_NEW": "24",
        "PREPARE_BATCH": "8",
        "STEPS": "3",
        "BATCH": "2",
        "SEEDS": "0",
        "LOSSES": f"fkl|{MIX}",
        "PARALLEL": "1",
        "THREADS": "1",
        "SPEC_PROMPTS": "2",
        "BUDGET": "900",
        "EXTRA": "draft.vocab_size=1024 eval.tau_prompts=2 eval.tau_tokens=8 "
        "eval.tau_prompt_tokens=8 eval.speculative.max_new_tokens=8 "
        "eval.speculative.prompt_tokens=8 acceptance_head.enabled=false train.warmup_steps=1",
        **env,
    }
    return subprocess.run(
        ["bash", str(STUDY), str(out)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **shrink},
        capture_output=True,
        text=True,
    )


def test_the_study_with_no_time_left_names_every_run_not_reached(tmp_path):
    done = study(tmp_path / "out", tmp_path / "runs", BUDGET="45", RESERVE="40")
    assert done.returncode == 0, done.stderr
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "== prepare: not run, the budget is spent" in done.stdout
    for recipe in ("smollm2-standalone", "smollm2-eagle3"):
        for label in ("fkl", "lk+tau"):
            assert f"- {recipe} {label} seed 0: not started: the budget was spent" in summary
    assert summary.count("No seed reached by every loss: no table.") == 2
    assert (tmp_path / "out" / "logs.tar.gz").is_file()


@pytest.mark.slow
def test_the_study_shrunk_to_the_embedded_pair_writes_each_recipes_table(tmp_path):
    done = study(tmp_path / "out", tmp_path / "runs")
    assert done.returncode == 0, done.stderr
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "16 training and 8 held-out" in summary
    assert "None: every run finished." in summary
    for recipe in ("smollm2-standalone", "smollm2-eagle3"):
        section = summary.split(f"## recipes/{recipe}.yaml")[1].split("\n## ")[0]
        rows = {line.split("|")[1].strip() for line in section.splitlines() if line[:2] == "| "}
        assert {"fkl", "lk+tau"} <= rows
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
        names = tar.getnames()
    for recipe in ("smollm2-standalone", "smollm2-eagle3"):
        for label in ("fkl", "lk+tau"):
            assert f"{recipe}/{label}-seed0/eval.json" in names
