"""`specdistill export` on hostile inputs: a `--tokenizer` that is not the draft's, a
`--speculative-tokens` no engine can run and a config.json that is not an object are each
one line, exit 2, with nothing written."""

import shutil

import pytest

from specdistill import cli


def _export(draft, out, *extra) -> list[str]:
    return ["export", "--draft", str(draft), "--format", "hf", "--out", str(out), *extra]


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    return lines[0]


def test_a_tokenizer_of_another_vocabulary_is_refused(
    tiny_pair, other_tokenizer_draft, tmp_path, capsys
):
    out = tmp_path / "out"
    argv = _export(tiny_pair[1], out, "--tokenizer", str(other_tokenizer_draft))
    assert cli.main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"--tokenizer {other_tokenizer_draft} is not the draft's tokenizer" in line
    assert "vocabularies differ" in line
    assert not out.exists()
    assert cli.main(_export(tiny_pair[1], out, "--tokenizer", str(tiny_pair[0]))) == 0


@pytest.mark.parametrize("n", ["0", "1000000000"])
def test_speculative_tokens_beyond_any_gamma_are_refused(tiny_head_dir, tmp_path, capsys, n):
    out = tmp_path / "out"
    argv = ["export", "--draft", str(tiny_head_dir), "--format", "vllm", "--out", str(out)]
    assert cli.main([*argv, "--speculative-tokens", n]) == 2
    assert "--speculative-tokens must be an integer in [1, 64]" in _one_line(
        capsys.readouterr().err
    )
    assert not out.exists()


@pytest.mark.parametrize("config", [b"[1, 2]", b'"text"', b"\xff\xfe\x00binary"])
def test_a_config_that_is_not_an_object_is_one_line(tiny_pair, tmp_path, capsys, config):
    draft = tmp_path / "draft"
    shutil.copytree(tiny_pair[1], draft)
    (draft / "config.json").write_bytes(config)
    out = tmp_path / "out"
    assert cli.main(_export(draft, out)) == 2
    assert "config.json" in _one_line(capsys.readouterr().err)
    assert not out.exists()
