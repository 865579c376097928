"""A fourth draft type in the drafts layer's terms only: a class that declares its name and
its capabilities, registered by one entry in `drafts.TYPES`. Nothing else changes: the
recipe takes its name, the recipe checks follow the capabilities it declares (refusing one it
lacks with the usual one-line error), and a tiny run trains it.

`stand_in` (the fixture) registers the type; it is meant for any test that needs a type the
project does not name anywhere.

A head with a folder format of its own (`head_package`) is one package in a temporary folder
and one registry entry (drafts/registry.py `register`): the generic paths (`drafts.detect`,
`drafts.type_of`, `load_draft`, `load_checked`) find, load and check it, and `specdistill
export` writes it with the writer it contributes (its `exports`, drafts/export.py).
"""

from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from specdistill import drafts
from specdistill.drafts import Standalone
from specdistill.train.config import RecipeError, load_recipe
from specdistill.train.trainer import Trainer
from tests.train.helpers import metrics, overrides

OWN_REFUSAL = "target.cache: a stand-in draft trains on the live target only"


@dataclass(frozen=True)
class StandIn(Standalone):
    """A standalone draft under another name, without a chunked loss (refused with the
    generic error) and without sparse targets (refused with its own)."""

    name = "stand_in"
    capabilities = replace(
        Standalone.capabilities,
        chunked_loss=False,
        sparse_targets=False,
        refusals={"sparse_targets": OWN_REFUSAL},
    )


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setitem(drafts.TYPES, StandIn.name, StandIn)
    return StandIn


def recipe(tiny_pair, out, **extra):
    return load_recipe(None, overrides(tiny_pair, out, **{"draft.type": "stand_in", **extra}))


def test_the_recipe_takes_a_registered_name_only(tiny_pair, tmp_path, monkeypatch):
    with pytest.raises(RecipeError, match=r"^draft.type must be one of standalone, eagle3, par"):
        recipe(tiny_pair, tmp_path)
    monkeypatch.setitem(drafts.TYPES, StandIn.name, StandIn)
    assert recipe(tiny_pair, tmp_path).draft.type == "stand_in"
    assert drafts.planned(recipe(tiny_pair, tmp_path).draft) is StandIn


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            {"loss.chunk_size": 16},
            "loss.chunk_size is not supported for draft.type=stand_in: set loss.chunk_size=null",
        ),
        ({"target.cache": "some/cache"}, OWN_REFUSAL),
        ({"draft.ttt_steps": 2}, "draft.ttt_steps apply to draft.type=eagle3 only"),
        ({"draft.model": "null"}, "draft.model must name the draft"),
    ],
)
def test_the_checks_refuse_what_it_does_not_declare(stand_in, tiny_pair, tmp_path, extra, message):
    with pytest.raises(RecipeError) as refused:
        recipe(tiny_pair, tmp_path, **extra)
    assert str(refused.value).startswith(message)
    assert "\n" not in str(refused.value)


def test_the_checks_take_what_it_declares(stand_in, tiny_pair, tmp_path):
    """What it inherits from the standalone type stays allowed: the accepted-length loss, a
    LoRA adapter, on-policy text from the draft."""
    extra = {
        "loss.name": "tau",
        "draft.lora.r": 4,
        "data.on_policy.fraction": 0.5,
        "data.on_policy.source": "draft",
        "data.on_policy.prompt_tokens": 8,
    }
    assert recipe(tiny_pair, tmp_path, **extra).loss.name == "tau"


def test_a_tiny_run_trains_it_as_the_standalone_type_would(stand_in, tiny_pair, tmp_path):
    """Two steps of the stand-in: the step builds and trains the stand-in type, and its
    numbers are the standalone draft's (the same class under another name)."""
    runs = {}
    for name in ("stand_in", "standalone"):
        out = tmp_path / name
        trainer = Trainer.from_recipe(
            recipe(tiny_pair, out, **{"draft.type": name, "train.max_steps": 2})
        )
        assert type(trainer.kind) is (StandIn if name == "stand_in" else Standalone)
        trainer.run()
        runs[name] = [(m["loss"], m["alpha"]) for m in metrics(out) if "loss" in m]
    assert len(runs["stand_in"]) == 2
    assert runs["stand_in"] == runs["standalone"]


# ----------------------------------------------------------------------------- its own folder
# A head with a folder format of its own (an MTP- or DFlash-like head), written as one package
# in a temporary folder: its model, its folder format, its hooks and its registration. Nothing
# in the project changes; the generic paths (detect, type_of, load_draft, load_checked) find it
# through the registry.

HEAD_PACKAGE = '''
"""A stand-in head: an embedding and an output layer, saved as config.json naming it
(`stand_in_head`: its sizes) and its weights in stand_in_head.safetensors."""

import json
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

from safetensors.torch import load_file, save_file
from torch import nn

from specdistill.drafts.export import Exports, Plan
from specdistill.drafts.registry import register
from specdistill.drafts.standalone import Standalone
from specdistill.models.hub import DTYPES

FIELD = "stand_in_head"
WEIGHTS = "stand_in_head.safetensors"


class Head(nn.Module):
    is_stand_in_head = True

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.vocab, self.hidden = vocab, hidden
        self.config = SimpleNamespace(hidden_size=hidden)  # what every draft module says
        self.embed = nn.Embedding(vocab, hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, **kwargs):
        return self.out(self.embed(input_ids))

    def save(self, out) -> None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        sizes = {"vocab": self.vocab, "hidden": self.hidden}
        (out / "config.json").write_text(json.dumps({FIELD: sizes}))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, out / WEIGHTS)


def sizes(path) -> dict | None:
    return json.loads((Path(path) / "config.json").read_text()).get(FIELD)


def write_head(head, options) -> Plan:
    """Its export (the hf format): its own folder format."""
    return Plan(head.save, options.verifier, options.speculative_tokens or 1)


def read_head(directory):
    return StandInHead.load(str(directory), dtype="float32")


@register(5)
@dataclass(frozen=True)
class StandInHead(Standalone):
    name = "stand_in_head"
    own_tokenizer = False  # a head: the target's tokenizer
    capabilities = replace(Standalone.capabilities, formats=("hf",), export_as="stand_in_head")
    exports = Exports(writers={"hf": write_head}, readers={"hf": read_head})

    @staticmethod
    def detect(path) -> bool:
        return sizes(path) is not None

    @staticmethod
    def detect_loaded(model) -> bool:
        return getattr(model, "is_stand_in_head", False)

    @staticmethod
    def meta_model(path):
        return Head(**sizes(path))

    @staticmethod
    def load(name, *, dtype, revision=None):
        head = Head(**sizes(name))
        head.load_state_dict(load_file(Path(name) / WEIGHTS))
        return head.to(DTYPES[dtype])

    @staticmethod
    def vocab_size_of(model) -> int:
        return model.vocab
'''


@pytest.fixture
def head_package(tmp_path, monkeypatch, draft_registry):
    """(the stand-in head's package, its folder): imported from a temporary folder; the
    registry and the imported modules are as before once the test ends."""
    import importlib
    import sys

    folder = tmp_path / "packages" / "stand_in_head_type"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(HEAD_PACKAGE)
    monkeypatch.syspath_prepend(str(folder.parent))
    monkeypatch.delitem(sys.modules, folder.name, raising=False)
    before = (dict(draft_registry.TYPES), draft_registry.detected())
    package = importlib.import_module(folder.name)
    yield package, folder, before
    sys.modules.pop(folder.name, None)


def test_a_head_with_its_own_folder_format_is_one_folder_and_one_registry_entry(
    head_package, tiny_pair, tmp_path, draft_registry
):
    """The head is added by one folder (its package: every file of it) and one registry
    entry; a saved head is then detected, loaded (with the checks before and after loading)
    and told apart as a module by the project's generic paths."""
    import inspect

    import torch

    from specdistill.drafts.checked_load import load_checked
    from specdistill.drafts.loader import load_draft
    from specdistill.models.hub import load_model, load_tokenizer

    package, folder, (types, order) = head_package
    kind = package.StandInHead
    assert [p.relative_to(folder).as_posix() for p in folder.rglob("*.py")] == ["__init__.py"]
    assert Path(inspect.getfile(kind)).parent == folder
    assert draft_registry.TYPES == {**types, kind.name: kind}
    assert draft_registry.detected() == (kind, *order)

    target = load_model(str(tiny_pair[0]))
    tokenizer = load_tokenizer(str(tiny_pair[0]))
    torch.manual_seed(0)
    head = package.Head(target.config.vocab_size, 8)
    saved = tmp_path / "head"
    head.save(saved)
    assert sorted(p.name for p in saved.iterdir()) == ["config.json", "stand_in_head.safetensors"]

    assert drafts.detect(saved) is kind
    loaded = load_draft(str(saved))
    assert drafts.type_of(loaded) is kind and drafts.detect(loaded) is kind
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(loaded(ids), head(ids))
    checked = load_checked(str(saved), target, tokenizer)
    assert torch.equal(checked(ids), head(ids))
    assert drafts.compared_vocab_size(target, draft=checked) == target.config.vocab_size
    # the other types are found as before
    assert drafts.type_of(target) is Standalone
    assert drafts.detect(tiny_pair[0]) is Standalone


def test_the_checked_load_refuses_its_weights_of_other_shapes_before_loading(
    head_package, tmp_path
):
    """The check before loading builds the head its folder describes on the meta device (its
    `meta_model` hook) and compares its shapes with the weight file's header."""
    import json

    from specdistill.drafts.checked_load import check_before_loading
    from specdistill.models.weights import IncompleteDraftError

    package, _, _ = head_package
    saved = tmp_path / "head"
    package.Head(16, 8).save(saved)
    check_before_loading(str(saved))
    (saved / "config.json").write_text(json.dumps({"stand_in_head": {"vocab": 16, "hidden": 4}}))
    with pytest.raises(IncompleteDraftError, match="embed.weight"):
        check_before_loading(str(saved))


def test_specdistill_export_writes_it_with_the_writer_it_contributes(
    head_package, tmp_path, capsys
):
    """The head's writer and reader (its `exports`) join the export's tables through the
    registry; `specdistill export` writes the head in its own folder format, reads it back
    and refuses a format it does not list."""
    import torch

    from specdistill import cli
    from specdistill.train.export import formats, load_export

    package, _, _ = head_package
    assert formats.writers("hf")["stand_in_head"] is package.write_head
    assert "stand_in_head" not in formats.writers("vllm")
    torch.manual_seed(0)
    head = package.Head(16, 8)
    saved = tmp_path / "head"
    head.save(saved)
    out = tmp_path / "out"
    argv = ["export", "--draft", str(saved), "--format", "hf", "--out", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert f"wrote hf export of the stand_in_head draft to {out}" in printed
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "stand_in_head.safetensors"]
    assert drafts.detect(out) is package.StandInHead
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(load_export(out, "hf")(ids), head(ids))
    argv = ["export", "--draft", str(saved), "--format", "vllm", "--out", str(tmp_path / "v")]
    assert cli.main(argv) == 2
    assert "a stand_in_head draft cannot be exported as vllm; formats: hf" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "v").exists()
