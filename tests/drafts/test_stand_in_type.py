"""A fourth draft type in the drafts layer's terms only: a class that declares its name and
its capabilities, registered by one entry in `drafts.TYPES`. Nothing else changes: the
recipe takes its name, the recipe checks follow the capabilities it declares (refusing one it
lacks with the usual one-line error), and a tiny run trains it.

`stand_in` (the fixture) registers the type; it is meant for any test that needs a type the
project does not name anywhere.
"""

from dataclasses import dataclass, replace

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
