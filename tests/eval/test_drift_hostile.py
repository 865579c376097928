"""Hostile inputs to `specdistill drift`: filters out of range, a seed past 64 bits, a prompt
that is not text and a traffic shard that is a directory are each one line and exit 2, with
no --out left behind; `--top-k 0` is "off", as in speculate."""

import json

import pytest

from specdistill.errors import run_guarded
from specdistill.eval import drift_cli


def _argv(tiny_pair, prompts, out, *extra) -> list[str]:
    target, draft, _ = tiny_pair
    return [
        "--draft", str(draft), "--target-before", str(target), "--target-after", str(target),
        "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "4",
        "--bootstrap", "20", "--num-prompts", "2", "--device", "cpu", *extra,
    ]  # fmt: skip


def _prompts(tmp_path, text: str = '{"prompt": "def f():\\n"}\n'):
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--top-p", "0", "needs a number in (0, 1]"),
        ("--top-p", "nan", "needs a number in (0, 1]"),
        ("--top-k", "-1", "needs an integer >= 0"),
        ("--seed", "123456789012345678901234", "needs an integer in [0, 9223372036854775807]"),
        ("--threads", "0", "needs an integer >= 1"),
    ],
)
def test_filters_and_seed_out_of_range_are_usage_errors(
    tiny_pair, tmp_path, capsys, option, value, message
):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as info:
        drift_cli.main(_argv(tiny_pair, _prompts(tmp_path), out, option, value))
    assert info.value.code == 2
    assert f"argument {option}: {message}" in capsys.readouterr().err
    assert not out.exists()


def test_top_k_0_is_off(tiny_pair, tmp_path):
    out = tmp_path / "out"
    assert drift_cli.main(_argv(tiny_pair, _prompts(tmp_path), out, "--top-k", "0")) == 0
    assert json.loads((out / "report.json").read_text())["n_prompts"] == 1


def test_a_lone_surrogate_prompt_is_one_line(tiny_pair, tmp_path, capsys):
    prompts = _prompts(tmp_path, '{"prompt": "a"}\n{"prompt": "\\ud800"}\n')
    out = tmp_path / "out"
    assert run_guarded(drift_cli.main, _argv(tiny_pair, prompts, out)) == 2
    err = capsys.readouterr().err
    assert err == f"error: {prompts}:2: 'prompt' holds a lone surrogate U+D800 at character 0, " \
        "which is not text\n"  # fmt: skip
    assert not out.exists()


def test_a_directory_named_like_a_shard_under_traffic_is_one_line(tiny_pair, tmp_path, capsys):
    traffic = tmp_path / "traffic"
    (traffic / "traffic-000000.jsonl").mkdir(parents=True)
    out = tmp_path / "out"
    argv = _argv(tiny_pair, _prompts(tmp_path), out, "--traffic", str(traffic))
    assert run_guarded(drift_cli.main, argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: --traffic {traffic}: traffic-000000.jsonl is not a regular file\n"
    assert not out.exists()
