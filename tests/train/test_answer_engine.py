"""The answering engine of `regenerate` and `prepare` (train/answer_engine.py) without vLLM:
`auto` picks what is installed, a missing vLLM is one error before anything is written, and a
directory answered by one engine or dtype is not continued by another."""

import json
import sys

import pytest

from specdistill.errors import UserError
from specdistill.train import answer_engine
from specdistill.train.config import load_recipe
from specdistill.train.regenerate import RegenerateError, Sampling, regenerate
from tests.train.helpers import overrides, read_answers

SAMPLING = Sampling(max_new_tokens=3)


def _quiet(*args) -> None:
    """A print that says nothing."""


@pytest.mark.parametrize(("installed", "chosen"), [(True, "vllm"), (False, "specdistill")])
def test_auto_answers_with_vllm_where_it_is_installed(monkeypatch, installed, chosen):
    spec = object() if installed else None
    monkeypatch.setattr(answer_engine.importlib.util, "find_spec", lambda name: spec)
    assert answer_engine.resolve("auto") == chosen
    assert answer_engine.resolve("specdistill") == "specdistill"
    with pytest.raises(RegenerateError, match="engine must be specdistill, vllm or auto"):
        answer_engine.resolve("sglang")


def test_a_missing_vllm_names_the_install_and_writes_no_answer(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # "not installed", as import sees it
    recipe = load_recipe(None, overrides(tiny_pair, tmp_path / "run"))
    out = tmp_path / "regen"
    with pytest.raises(UserError, match=r"needs vLLM.*pip install"):
        regenerate(recipe, out, sampling=SAMPLING, limit=2, engine="vllm", print=_quiet)
    assert not list(out.glob("regen-*.jsonl")) and not (out / "manifest.json").exists()


def test_answers_in_one_dtype_are_not_continued_in_another(tiny_pair, tmp_path):
    out = tmp_path / "regen"
    first = load_recipe(None, overrides(tiny_pair, tmp_path / "run"))
    manifest = regenerate(first, out, sampling=SAMPLING, limit=2, print=_quiet)
    assert manifest["answered_in"] == {"engine": "specdistill", "dtype": "float32"}
    answers = read_answers(out)
    other = load_recipe(
        None, overrides(tiny_pair, tmp_path / "run", **{"target.dtype": "bfloat16"})
    )
    with pytest.raises(RegenerateError, match="would mix two distributions"):
        regenerate(other, out, sampling=SAMPLING, limit=4, print=_quiet)
    assert read_answers(out) == answers  # nothing lost, nothing added

    # a manifest written before `answered_in` was: the project's engine, in the target's dtype
    path = out / "manifest.json"
    old = json.loads(path.read_text())
    del old["answered_in"]
    path.write_text(json.dumps(old))
    more = regenerate(first, out, sampling=SAMPLING, limit=4, print=_quiet)
    assert more["answered"] == 4 and len(read_answers(out)) == 4
