"""Hostile inputs to `specdistill speculate`: each is one clear error before any model loads, or
is bounded and said (a `--max-new-tokens` beyond the target's context)."""

import json
import re
import types

import pytest
import torch

from specdistill.errors import UserError, run_guarded
from specdistill.eval import speculative as spec
from specdistill.eval.prompts import PromptError, encode_prompts, load_prompts


def _argv(tmp_path, *extra: str, prompts: str = '{"prompt": "a b"}\n') -> list[str]:
    path = tmp_path / "prompts.jsonl"
    path.write_text(prompts)
    return [
        "--target", "tiny:target", "--draft", "tiny:draft", "--prompts", str(path),
        "--out", str(tmp_path / "out"), *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "line, field",
    [
        ('{"prompt": "a\\ud800b"}', "prompt"),
        ('{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages\\[0\\].content"),
        ('{"id": "\\ud800", "prompt": "a"}', "id"),
    ],
)
def test_a_lone_surrogate_is_named_with_file_and_line(tmp_path, no_models, capsys, line, field):
    argv = _argv(tmp_path, prompts='{"prompt": "ok"}\n' + line + "\n")
    assert run_guarded(spec.main, argv) == 2
    err = capsys.readouterr().err
    assert re.search(rf"prompts\.jsonl:2: '{field}' holds a lone surrogate U\+D[8C]00", err), err
    assert len(err.strip().splitlines()) == 1 and not no_models
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["p.json", "p.jsonl"])
def test_a_prompt_file_nested_100000_deep_is_one_error(tmp_path, name):
    path = tmp_path / name
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(PromptError, match=r"p\.jsonl?(:1)?: JSON nested too deeply"):
        load_prompts(path)


def test_an_empty_prompt_is_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"text": ""}\n')
    with pytest.raises(PromptError, match=r"p\.jsonl:2: 'text' is empty"):
        load_prompts(path)


def test_a_prompt_of_no_tokens_is_refused():
    class NoTokens:
        chat_template = None

        def __call__(self, text, add_special_tokens):
            return {"input_ids": []}

    prompt = types.SimpleNamespace(id="7", text=" ", messages=None)
    with pytest.raises(PromptError, match="prompt 7: the tokenizer makes no tokens of it"):
        encode_prompts([prompt], NoTokens())


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--threads", "-1", "needs an integer >= 1"),
        ("--threads", "0", "needs an integer >= 1"),
        ("--seed", "123456789012345678901234", r"needs an integer in \[0, 9223372036854775807\]"),
        ("--seed", "-1", r"needs an integer in \[0, "),
    ],
)
def test_threads_and_seed_out_of_range_are_usage_errors(
    tmp_path, capsys, no_models, option, value, message
):
    with pytest.raises(SystemExit) as info:
        spec.main(_argv(tmp_path, option, value))
    assert info.value.code == 2
    assert re.search(rf"argument {option}: {message}", capsys.readouterr().err)
    assert not no_models


@pytest.mark.parametrize(
    "device, message",
    [
        ("evil", "--device 'evil': not a device torch knows"),
        pytest.param(
            "cuda",
            "--device cuda: not available on this machine",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
        ),
    ],
)
def test_a_bad_or_absent_device_is_one_line_before_models_load(
    tmp_path, capsys, no_models, device, message
):
    assert run_guarded(spec.main, _argv(tmp_path, "--device", device)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and len(err.strip().splitlines()) == 1
    assert not no_models and not (tmp_path / "out").exists()


def test_max_new_tokens_is_bounded_by_the_context_and_said(tmp_path, tiny_pair, capsys):
    target, draft, _ = tiny_pair  # a 128-position target
    argv = [
        "--target", str(target), "--draft", str(draft), "--prompts",
        str(tmp_path / "prompts.jsonl"), "--out", str(tmp_path / "out"), "--gamma", "2",
        "--max-new-tokens", "100000000",
    ]  # fmt: skip
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "def f"}\n')
    result = spec.main(argv)
    new = result["settings"]["max_new_tokens"]
    err = capsys.readouterr().err
    assert f"--max-new-tokens 100000000 lowered to {new}: the target's context is 128" in err
    assert 0 < new < 128
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["settings"]["max_new_tokens"] == new


def test_a_prompt_that_fills_the_context_is_one_error():
    target = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=8))
    with pytest.raises(UserError, match="longest prompt has 8 tokens.*--max-prompt-tokens below 8"):
        spec.within_context(target, [[1] * 3, [1] * 8], 4)
    assert spec.within_context(target, [[1] * 3], 4) == 4
