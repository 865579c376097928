"""`specdistill drift` on bad inputs: a bad prompt file names its file and line before
anything is created, a failed run leaves no --out behind, a used --out is refused unless
--overwrite."""

import json
import re

import pytest

from specdistill.eval import drift_cli
from specdistill.eval.prompts import PromptError
from specdistill.publish import OutputDirError


def _argv(tiny_pair, prompts, out, *extra) -> list[str]:  # noqa: F811
    target, draft, _ = tiny_pair
    return [
        "--draft", str(draft), "--target-before", str(target), "--target-after", str(target),
        "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "4",
        "--bootstrap", "20", "--num-prompts", "2", "--device", "cpu", *extra,
    ]  # fmt: skip


def _prompts(tmp_path, *records) -> object:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_prompt_that_is_not_text_names_file_and_line(tiny_pair, tmp_path):  # noqa: F811
    prompts = _prompts(tmp_path, {"prompt": "def f():\n"}, {"prompt": 123})
    out = tmp_path / "out"
    match = rf"^{re.escape(str(prompts))}:2: 'prompt' must be a string, got int"
    with pytest.raises(PromptError, match=match):
        drift_cli.main(_argv(tiny_pair, prompts, out))
    assert not out.exists()


def test_a_utf16_prompt_file_is_named(tiny_pair, tmp_path):  # noqa: F811
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f():\n"}) + "\n", encoding="utf-16")
    out = tmp_path / "out"
    with pytest.raises(PromptError, match=rf"^{re.escape(str(prompts))}: UTF-16 text"):
        drift_cli.main(_argv(tiny_pair, prompts, out))
    assert not out.exists()


def test_a_failed_run_leaves_no_out(tiny_pair, tmp_path):  # noqa: F811
    prompts = _prompts(tmp_path, {"prompt": "def f():\n"})
    out = tmp_path / "runs" / "drift"
    argv = _argv(tiny_pair, prompts, out)
    argv[argv.index("--draft") + 1] = str(tmp_path / "no-such-draft")
    with pytest.raises(OSError):
        drift_cli.main(argv)
    assert not (tmp_path / "runs").exists()


def test_a_used_out_is_refused_unless_overwrite(tiny_pair, tmp_path):  # noqa: F811
    prompts = _prompts(tmp_path, {"prompt": "def f():\n"}, {"prompt": "class A:\n"})
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("an earlier report")
    with pytest.raises(OutputDirError, match=r"already holds report\.md.*--overwrite"):
        drift_cli.main(_argv(tiny_pair, prompts, out))
    assert (out / "report.md").read_text() == "an earlier report"
    assert drift_cli.main(_argv(tiny_pair, prompts, out, "--overwrite")) == 0
    assert json.loads((out / "report.json").read_text())["n_prompts"] == 2
    assert (out / "report.md").read_text().startswith("# α drift report")
