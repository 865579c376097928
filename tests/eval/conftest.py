"""Fixtures shared by the evaluation tests: the verbs' model stand-in, and the speculative
engine's tiny target/draft pairs with their prompts."""

import sys
import types

import pytest
import torch

from tests.eval.helpers import N_NEW, V_SMALL, perturbed, reference_greedy, tiny_llama


@pytest.fixture
def no_models(monkeypatch):
    """Stand-ins for specdistill.models.hub and specdistill.drafts.loader that record every
    load instead of loading."""
    calls = []
    fake = types.ModuleType("specdistill.models.hub")
    fake_loader = types.ModuleType("specdistill.drafts.loader")

    def load(name, *args, **kwargs):
        calls.append(name)
        raise RuntimeError("stop: a model would load here")

    fake.load_tokenizer = fake.load_model = fake.load_target = fake_loader.load_draft = load
    fake.check_tokenizers = lambda *args: None
    monkeypatch.setitem(sys.modules, "specdistill.models.hub", fake)
    monkeypatch.setitem(sys.modules, "specdistill.drafts.loader", fake_loader)
    return calls


@pytest.fixture(scope="module")
def perturbed_pair():
    """(target, draft): a tiny random Llama (96 tokens) and a slightly perturbed copy of it."""
    target = tiny_llama(0, vocab=96, hidden=64, layers=2, init=0.2)
    return target, perturbed(target, 0.015, seed=1)


@pytest.fixture(scope="module")
def prompts():
    """Five random prompts of 1 to 11 tokens of a 96-token vocabulary."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 11, 6, 1, 8)]


@pytest.fixture(scope="module")
def references(perturbed_pair, prompts):
    """The perturbed pair's target's own greedy continuation of each prompt (N_NEW tokens)."""
    return [reference_greedy(perturbed_pair[0], p, N_NEW) for p in prompts]


@pytest.fixture(scope="module")
def small_perturbed_pair():
    """(target, draft) over V_SMALL tokens, for the χ² tests of sampling."""
    target = tiny_llama(0, vocab=V_SMALL, hidden=32, layers=1, init=0.2)
    return target, perturbed(target, 0.04, seed=1)
