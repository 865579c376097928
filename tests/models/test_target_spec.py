"""models/target_spec.py: the target spec of a recipe or of a verb's flags, the one loader of a
target and its tokenizer, and that nothing else in the package loads a target itself."""

import ast
import shutil
import sys
import types
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from specdistill.models import hub
from specdistill.models.target_spec import (
    TargetSpec,
    load_target_and_tokenizer,
    load_tokenizer,
)
from specdistill.train.recipe import TargetConfig
from tests.package_modules import REPO, modules

LOADER = "models/target_spec.py"
# Package modules that call hub.load_target for something that is no run's target, each
# with its reason.
ALLOWED_CALLERS = {
    "models/hub.py": "defines load_target (and loads a base model to check an adapter on it)",
    LOADER: "the loader itself",
    "train/finetune.py": "merges a fine-tune's adapter into its base model to save the merged "
    "model (export of a fine-tune), which is not a target a run decodes or trains against",
}


def test_the_spec_of_a_recipe_carries_adapter_revision_and_dtype():
    section = TargetConfig(
        model="some/model", adapter="/adapters/ft", revision="v2", dtype="bfloat16"
    )
    spec = TargetSpec.from_recipe(section)
    assert spec == TargetSpec("some/model", "/adapters/ft", "v2", "bfloat16", None)
    assert TargetSpec.from_recipe(section, device="cpu").device == "cpu"
    with pytest.raises(AttributeError):  # frozen: one spec, never edited on the way
        spec.model = "other"


def test_the_spec_of_a_verbs_flags():
    args = SimpleNamespace(target="t", target_adapter="a", dtype="float16")
    assert TargetSpec.from_args(args, device="cpu") == TargetSpec("t", "a", None, "float16", "cpu")


def test_the_loader_passes_every_field_of_the_spec(monkeypatch):
    calls = []
    tok = SimpleNamespace(pad_token_id=None, eos_token="</s>", pad_token=None)
    model = SimpleNamespace(to=lambda device: ("moved", device))

    def fake_tokenizer(name, revision=None):
        calls.append(("tokenizer", name, revision))
        return tok

    def fake_target(name, adapter=None, *, dtype="float32", revision=None):
        calls.append(("target", name, adapter, dtype, revision))
        return model

    monkeypatch.setattr(hub, "load_tokenizer", fake_tokenizer)
    monkeypatch.setattr(hub, "load_target", fake_target)
    spec = TargetSpec("m", "ad", "rev", "bfloat16", "cuda:1")
    target, tokenizer = load_target_and_tokenizer(spec)
    assert calls == [("tokenizer", "m", "rev"), ("target", "m", "ad", "bfloat16", "rev")]
    assert target == ("moved", "cuda:1") and tokenizer is tok and tok.pad_token == "</s>"
    # Given ones are kept (the tokenizer still gets its pad token); nothing else loads.
    calls.clear()
    other = SimpleNamespace(pad_token_id=None, eos_token="<e>", pad_token=None)
    assert load_target_and_tokenizer(spec, target="T", tokenizer=other) == ("T", other)
    assert calls == [] and other.pad_token == "<e>"


def test_the_loader_uses_the_hub_module_of_the_moment(monkeypatch):
    """A stand-in for models/hub.py put in sys.modules after the loader was imported (the
    verbs' tests do) is the one that loads."""
    fake = types.ModuleType("specdistill.models.hub")
    fake.load_tokenizer = lambda name, revision=None: SimpleNamespace(pad_token_id=0)
    fake.load_target = lambda name, adapter=None, *, dtype, revision: f"fake {name}"
    monkeypatch.setitem(sys.modules, "specdistill.models.hub", fake)
    assert load_target_and_tokenizer(TargetSpec("m"))[0] == "fake m"


@pytest.fixture
def no_pad_target(tiny_pair, tmp_path):
    """The tiny target, saved with a tokenizer that has no pad token."""
    target = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(target)
    assert AutoTokenizer.from_pretrained(target).pad_token_id is None
    return target


def test_the_loader_sets_the_pad_token(no_pad_target):
    spec = TargetSpec(str(no_pad_target))
    target, tokenizer = load_target_and_tokenizer(spec)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id is not None
    assert target.config.vocab_size >= len(tokenizer)
    assert load_tokenizer(spec).pad_token_id == tokenizer.eos_token_id


def target_loads(source: str) -> list[int]:
    """Lines of `source` that call `load_target` (any `x.load_target(...)` or a bare
    `load_target(...)`) or import it from models.hub."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "load_target":
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("hub"):
            if any(alias.name == "load_target" for alias in node.names):
                lines.append(node.lineno)
    return lines


def test_the_scan_sees_a_direct_load():
    assert target_loads("from specdistill.models import hub\nhub.load_target('m')\n") == [2]
    assert target_loads("from specdistill.models.hub import load_target\n") == [1]
    assert target_loads("models.load_target(\n  'm', None)\n") == [1]
    assert target_loads("load_target_and_tokenizer(spec)\n") == []


def test_no_module_loads_a_target_but_through_the_loader():
    for where in ALLOWED_CALLERS:
        assert (REPO / where).is_file(), f"{where}: allowed, but no longer there"
    found = [
        f"{rel}:{line}"
        for path in modules().values()
        if (rel := str(path.relative_to(REPO))) not in ALLOWED_CALLERS
        for line in target_loads(path.read_text())
    ]
    assert not found, (
        "load the target through models/target_spec.py `load_target_and_tokenizer` "
        "(it passes the adapter, revision and dtype and sets the pad token):\n  "
        + "\n  ".join(found)
    )
