"""Fixtures shared by the evaluation verbs' tests."""

import sys
import types

import pytest


@pytest.fixture
def no_models(monkeypatch):
    """Stand-in for specdistill.drafts.hub that records every load instead of loading."""
    calls = []
    fake = types.ModuleType("specdistill.drafts.hub")

    def load(name, *args, **kwargs):
        calls.append(name)
        raise RuntimeError("stop: a model would load here")

    fake.load_tokenizer = fake.load_model = fake.load_draft = fake.load_target = load
    fake.check_tokenizers = lambda *args: None
    monkeypatch.setitem(sys.modules, "specdistill.drafts.hub", fake)
    return calls
