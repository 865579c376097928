"""`specdistill prepare` / `regenerate` on hostile inputs: a second writer on one directory,
held-out answers written into the training directory, prompt files with nothing to answer,
and damaged output directories are each one line and a non-zero exit; nothing is answered
twice and nothing is written before the problem is found."""

import errno
import json

import pytest

from specdistill import cli
from specdistill.publish import DirLock
from specdistill.train import regenerate_output
from tests.train.helpers import prepare_overrides, read_answers


def _prepare(tiny_pair, tmp_path, **extra) -> list[str]:
    extra = {"prepare.eval.prompts": "null", "data.eval": "null", **extra}
    return ["prepare", "--batch-size", "4", *prepare_overrides(tiny_pair, tmp_path, **extra)]


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith(("error:", "recipe error:"))]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _files(out) -> dict[str, bytes]:
    """The bytes of each file of `out` but its lock."""
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"}


def test_a_second_prepare_on_one_directory_is_refused(tiny_pair, tmp_path, capsys):
    out = tmp_path / "answers"
    with DirLock(out, "another prepare or regenerate"):  # a first run, still writing
        assert cli.main(_prepare(tiny_pair, tmp_path)) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"{out} is in use by another prepare or regenerate" in line
    assert not list(out.glob("regen-*.jsonl"))
    assert cli.main(_prepare(tiny_pair, tmp_path)) == 0  # once it is done: one set of answers
    answers = read_answers(out)
    assert len({a["prompt_hash"] for a in answers}) == len(answers) == 6


def test_held_out_answers_in_the_training_directory_are_refused(tiny_pair, tmp_path, capsys):
    same = tmp_path / "answers"
    argv = [
        "prepare",
        *prepare_overrides(
            tiny_pair,
            tmp_path,
            **{
                "prepare.eval.out": f"{tmp_path}/./answers",
                "data.eval": f"{tmp_path}/./answers/regen-*.jsonl",
            },
        ),
    ]
    assert cli.main(argv) == 2
    assert f"is prepare.train.out ({same})" in _one_line(capsys.readouterr().err)
    assert not same.exists()


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("empty.jsonl", b""),
        ("binary.jsonl", bytes(range(256)) * 4),
        ("utf16.jsonl", '{"text": "def f(x): return x"}\n'.encode("utf-16")),
        ("lists.jsonl", b'[1, 2]\n"text"\n3\n'),
        ("deep.jsonl", b"[" * 100_000 + b"]" * 100_000 + b"\n"),
        ("deep.json", b"[" * 100_000 + b"]" * 100_000),
    ],
)
def test_prompts_with_nothing_to_answer_are_one_line(tiny_pair, tmp_path, capsys, name, content):
    prompts = tmp_path / name
    prompts.write_bytes(content)
    assert cli.main(_prepare(tiny_pair, tmp_path, **{"prepare.train.prompts": str(prompts)})) == 2
    assert "no prompt to answer" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "answers" / "manifest.json").exists()


@pytest.mark.parametrize("manifest", [b"not json", b"[1, 2]", b"{}", b"\x00\xff\xfe" * 10])
def test_a_damaged_manifest_is_one_line(tiny_pair, tmp_path, capsys, manifest):
    out = tmp_path / "answers"
    assert cli.main(_prepare(tiny_pair, tmp_path)) == 0
    (out / "manifest.json").write_bytes(manifest)
    shards = {p.name: p.read_bytes() for p in out.glob("regen-*.jsonl")}
    assert cli.main(_prepare(tiny_pair, tmp_path)) == 2
    assert "manifest.json is damaged" in _one_line(capsys.readouterr().err)
    assert {p.name: p.read_bytes() for p in out.glob("regen-*.jsonl")} == shards


@pytest.mark.parametrize("garbage", [b"\x00\x01garbage\n", b"[1, 2]\n", b'{"text": "x"}\n'])
def test_a_garbage_shard_is_named_not_trained_beside(tiny_pair, tmp_path, capsys, garbage):
    out = tmp_path / "answers"
    assert cli.main(_prepare(tiny_pair, tmp_path)) == 0
    (out / "regen-000099.jsonl").write_bytes(garbage)
    assert cli.main(_prepare(tiny_pair, tmp_path)) == 2
    assert "regen-000099.jsonl:1 is not an answer" in _one_line(capsys.readouterr().err)


def test_a_lock_that_is_a_directory_is_one_line(tiny_pair, tmp_path, capsys):
    (tmp_path / "answers" / ".lock").mkdir(parents=True)
    assert cli.main(_prepare(tiny_pair, tmp_path)) == 2
    assert ".lock: cannot take the lock" in _one_line(capsys.readouterr().err)


def test_a_full_disk_is_one_line_and_a_rerun_resumes(tiny_pair, tmp_path, capsys, monkeypatch):
    real_write, written = regenerate_output.os.write, []

    def full_after_two(fd, data):
        if len(written) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(data)
        return real_write(fd, data)

    monkeypatch.setattr(regenerate_output.os, "write", full_after_two)
    assert cli.main(_prepare(tiny_pair, tmp_path)) == 2
    assert "No space left on device" in _one_line(capsys.readouterr().err)
    monkeypatch.undo()
    assert len(read_answers(tmp_path / "answers")) == 2
    assert cli.main(_prepare(tiny_pair, tmp_path)) == 0
    answers = read_answers(tmp_path / "answers")
    assert len({a["prompt_hash"] for a in answers}) == len(answers) == 6
    assert json.loads((tmp_path / "answers" / "manifest.json").read_text())["complete"]


@pytest.mark.parametrize(
    "garbage, line",
    [
        (b"\x00\x01garbage\n", 1),
        (b"[1, 2]\n", 1),
        (b'{"attempts": 3}\n', 1),
        (b'{"prompt_hash": "ab", "attempts": 1, "runs": 1}\nnot json\n', 2),
        (b"\xff\xfe" * 8, 1),
    ],
)
def test_a_garbage_failures_file_is_named_not_skipped(tiny_pair, tmp_path, capsys, garbage, line):
    """failures.jsonl is only ever replaced whole: a line that is no failure of ours is
    damage, named before anything is written, not a line silently dropped (and its
    attempt counts with it) on the next rewrite."""
    out = tmp_path / "answers"
    assert cli.main(_prepare(tiny_pair, tmp_path)) == 0
    (out / "failures.jsonl").write_bytes(garbage)
    before = _files(out)
    assert cli.main(_prepare(tiny_pair, tmp_path)) == 2
    assert f"failures.jsonl:{line} is not a failure record" in _one_line(capsys.readouterr().err)
    assert _files(out) == before
