"""Bad inputs to the speculative-decoding CLI fail at once, with a message naming the culprit."""

import gzip
import json
import os
import re

import pytest

from specdistill.eval import speculative as spec
from specdistill.eval.prompts import PromptError, load_prompts
from specdistill.publish import OutputDirError


def at(path) -> str:
    """Regex for a message's leading file name."""
    return re.escape(str(path))


def _write(path, text: str) -> None:
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")


@pytest.mark.parametrize("name", ["p.jsonl", "p.jsonl.gz"])
def test_malformed_jsonl_line_names_file_and_line(tmp_path, name):
    path = tmp_path / name
    # Line 2 is blank and still counts: the broken record is on line 3.
    _write(path, json.dumps({"prompt": "a"}) + "\n\n" + '{"prompt": "b"\n')
    with pytest.raises(PromptError, match=rf"^{at(path)}:3: invalid JSON: ") as info:
        load_prompts(path)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("name", ["p.jsonl", "p.jsonl.gz"])
def test_record_without_prompt_field_names_file_line_and_fields(tmp_path, name):
    path = tmp_path / name
    _write(path, "\n" + json.dumps({"prompt": "a"}) + "\n" + json.dumps({"question": "?"}))
    with pytest.raises(PromptError, match=rf"^{at(path)}:3: .*messages / turns / prompt / text"):
        load_prompts(path)
    _write(path, json.dumps(["not", "an", "object"]))
    with pytest.raises(PromptError, match=rf"^{at(path)}:1: expected a JSON object"):
        load_prompts(path)


def test_jsonl_line_numbers_ignore_unicode_line_separators(tmp_path):
    # U+2028 may appear unescaped inside a JSON string; it does not end a .jsonl line.
    path = tmp_path / "p.jsonl"
    text = json.dumps({"prompt": "a\u2028b"}, ensure_ascii=False) + "\n" + "{oops}\n"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PromptError, match=rf"^{at(path)}:2: "):
        load_prompts(path)
    path.write_text(text.split("\n")[0], encoding="utf-8")
    assert load_prompts(path)[0].text == "a\u2028b"


def test_malformed_json_names_file_and_line(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('[\n  {"prompt": "a"},\n  {"prompt" "b"}\n]\n')
    with pytest.raises(PromptError, match=rf"^{at(path)}:3: invalid JSON: "):
        load_prompts(path)


def _argv(tmp_path, *extra: str, out=None) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b"}) + "\n")
    out = tmp_path / "out" if out is None else out
    return [
        "--target", "tiny:target", "--draft", "tiny:draft", "--prompts", str(prompts),
        "--out", str(out), *extra,
    ]  # fmt: skip


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        spec.main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("value", ["", ",", "x", "1,x", "0", "2,-1", "1.5"])
def test_gamma_needs_integers_at_least_one(tmp_path, capsys, no_models, value):
    err = _usage_error(_argv(tmp_path, "--gamma", value), capsys)
    assert "argument --gamma: needs at least one integer >= 1" in err
    assert not no_models


@pytest.mark.parametrize("value", ["", "x", "-0.5", "0,-1", "nan", "inf"])
def test_temperature_needs_numbers_at_least_zero(tmp_path, capsys, no_models, value):
    err = _usage_error(_argv(tmp_path, "--temperature", value), capsys)
    assert "argument --temperature: needs at least one number >= 0" in err
    assert not no_models


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--batch-size", "0", "needs an integer >= 1"),
        ("--batch-size", "-2", "needs an integer >= 1"),
        ("--max-new-tokens", "0", "needs an integer >= 1"),
        ("--num-prompts", "0", "needs an integer >= 1"),
        ("--max-prompt-tokens", "0", "needs an integer >= 1"),
        ("--top-k", "-1", "needs an integer >= 0"),
        ("--top-k", "x", "needs an integer >= 0"),
        ("--top-p", "0", "needs a number in (0, 1]"),
        ("--top-p", "1.5", "needs a number in (0, 1]"),
        ("--top-p", "nan", "needs a number in (0, 1]"),
    ],
)
def test_scalar_options_out_of_range(tmp_path, capsys, no_models, option, value, message):
    err = _usage_error(_argv(tmp_path, option, value), capsys)
    assert f"argument {option}: {message}" in err
    assert not no_models


def test_help_documents_batch_size(capsys):
    with pytest.raises(SystemExit) as info:
        spec.main(["--help"])
    assert info.value.code == 0
    assert "requests decoded together; >= 1" in " ".join(capsys.readouterr().out.split())


def test_out_that_is_a_file_fails_before_loading_models(tmp_path, capsys, no_models):
    out = tmp_path / "report.json"
    out.write_text("{}")
    err = _usage_error(_argv(tmp_path, out=out), capsys)
    assert f"--out: {out} exists and is not a directory" in err
    assert not no_models
    # Below a file: cannot be created.
    err = _usage_error(_argv(tmp_path, out=out / "sub"), capsys)
    assert f"--out: {out / 'sub'} is not a writable directory" in err
    assert not no_models


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into a read-only directory")
def test_out_not_writable_fails_before_loading_models(tmp_path, capsys, no_models):
    out = tmp_path / "locked"
    out.mkdir()
    out.chmod(0o500)
    try:
        err = _usage_error(_argv(tmp_path, out=out), capsys)
    finally:
        out.chmod(0o700)
    assert f"--out: {out} is not a writable directory" in err
    assert not no_models


def test_out_created_by_a_failed_run_is_removed_again(tmp_path, no_models):
    out = tmp_path / "a" / "b"
    with pytest.raises(RuntimeError, match="stop: a model would load here"):
        spec.main(_argv(tmp_path, out=out))
    assert not (tmp_path / "a").exists()  # created for the run, removed with its failure
    assert no_models == ["tiny:target"]
    out.mkdir(parents=True)  # one that existed stays, empty: the probe file is gone
    with pytest.raises(RuntimeError, match="stop: a model would load here"):
        spec.main(_argv(tmp_path, out=out))
    assert out.is_dir() and not list(out.iterdir())


def test_used_out_is_refused_unless_overwrite(tmp_path, no_models):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("an earlier run's report")
    with pytest.raises(OutputDirError, match=rf"{at(out)} already holds report\.md.*--overwrite"):
        spec.main(_argv(tmp_path, out=out))
    assert not no_models and (out / "report.md").read_text() == "an earlier run's report"
    with pytest.raises(RuntimeError, match="stop: a model would load here"):
        spec.main(_argv(tmp_path, "--overwrite", out=out))
    assert (out / "report.md").is_file()  # a failed run removes nothing that holds files


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": 123}, "'prompt' must be a string, got int"),
        ({"text": None}, "'text' must be a string, got null"),
        ({"turns": [["a"]]}, "'turns\\[0\\]' must be a string, got list"),
        ({"messages": [{"role": "user"}]}, "'messages\\[0\\].content' must be a string"),
        ({"messages": "hi"}, "'messages' must be a non-empty list"),
    ],
)
def test_prompt_fields_of_the_wrong_type_name_file_and_line(tmp_path, record, message):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(PromptError, match=rf"^{at(path)}:2: {message}"):
        load_prompts(path)


def test_utf16_and_non_utf8_files_name_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n", encoding="utf-16")
    with pytest.raises(PromptError, match=rf"^{at(path)}: UTF-16 text; save it as UTF-8"):
        load_prompts(path)
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "\xff"}\n')
    with pytest.raises(PromptError, match=rf"^{at(path)}:3: not UTF-8 \(invalid start byte"):
        load_prompts(path)
    gz = tmp_path / "p.jsonl.gz"
    gz.write_bytes(b"not gzip")
    with pytest.raises(PromptError, match=rf"^{at(gz)}: not a readable gzip file"):
        load_prompts(gz)


def test_bad_prompt_file_fails_before_loading_models(tmp_path, no_models):
    argv = _argv(tmp_path)
    (tmp_path / "prompts.jsonl").write_text("{broken\n")
    with pytest.raises(PromptError, match=r"prompts\.jsonl:1: "):
        spec.main(argv)
    assert not no_models
