"""`specdistill regenerate` on hostile inputs: a seed past 64 bits and an --out that is a file
are refused before anything runs, a record holding a lone surrogate is a counted skip, and
prompts that failed make the exit status 1."""

import json

import pytest

from specdistill import cli
from specdistill.eval import engine
from tests.train.helpers import overrides


def _argv(tiny_pair, tmp_path, out, *extra, data=None) -> list[str]:
    more = {"data.train": str(data)} if data else {}
    return [
        "regenerate", "--out", str(out), "--max-new-tokens", "2", *extra,
        *overrides(tiny_pair, tmp_path / "u", **more),
    ]  # fmt: skip


@pytest.mark.parametrize("seed", ["123456789012345678901234", "-1", str(2**63)])
def test_a_seed_beyond_63_bits_is_refused_before_anything(tiny_pair, tmp_path, capsys, seed):
    out = tmp_path / "regen"
    assert cli.main(_argv(tiny_pair, tmp_path, out, "--seed", seed)) == 2
    err = capsys.readouterr().err
    assert f"error: --seed must be an integer in [0, 2**63 - 1] (a torch seed, offset per " \
        f"prompt), got {seed}" in err  # fmt: skip
    assert not out.exists()


def test_an_out_that_is_a_file_is_refused_and_kept(tiny_pair, tmp_path, capsys):
    out = tmp_path / "answers.jsonl"
    out.write_text("keep me\n")
    assert cli.main(_argv(tiny_pair, tmp_path, out)) == 2
    assert capsys.readouterr().err == f"error: --out {out} exists and is not a directory\n"
    assert out.read_text() == "keep me\n"


def test_a_lone_surrogate_record_is_skipped_and_counted(tiny_pair, tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text(
        '{"messages": [{"role": "user", "content": "write \\ud800 code"}]}\n'
        '{"text": "def \\udfff f(x): return x"}\n'
        '{"messages": [{"role": "user", "content": "write code"}]}\n'
    )
    out = tmp_path / "regen"
    assert cli.main(_argv(tiny_pair, tmp_path, out, data=data)) == 0
    err = capsys.readouterr().err
    for line in (1, 2):
        assert f"skipped {data}:{line}: not UTF-8 text (it holds a lone surrogate)" in err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["skipped"] == {"not UTF-8": 2}
    assert manifest["prompts"] == manifest["answered"] == 1 and manifest["complete"]


def test_failed_answers_exit_1(tiny_pair, tmp_path, capsys, monkeypatch):
    def fails(*args, **kwargs):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(engine, "generate", fails)
    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "write code"}]}\n')
    out = tmp_path / "regen"
    assert cli.main(_argv(tiny_pair, tmp_path, out, "--retries", "0", data=data)) == 1
    assert "regenerate: 0/1 answered, 1 failed" in capsys.readouterr().err
    assert len((out / "failures.jsonl").read_text().splitlines()) == 1
