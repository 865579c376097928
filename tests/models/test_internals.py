"""The transformers/torch internals models/lean.py and models/kv_cache.py read: present in the
installed versions; when one is missing (as in a release they were not written for), the
stream keeps transformers' forward / transformers' own cache layers, gives the same logits,
and one warning names what was missing. A peft-wrapped model gets the cache as `cache`."""

import logging
import warnings

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from specdistill.models import kv_cache, lean
from specdistill.models.kv_cache import GrowingLayer, KVStream, cache_keyword
from tests.models.helpers import CHANGES, VOCAB, build, run_stream

CPU = torch.device("cpu")


def lean_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == lean.__name__]


def test_the_installed_versions_have_every_internal():
    model = build("llama")
    assert lean.missing_internal(model) is None
    assert kv_cache.growing_layer_problem() is None
    stream = KVStream(model, VOCAB, CPU)
    assert stream.lean is not None
    assert all(type(layer) is GrowingLayer for layer in stream.cache.layers)


@pytest.mark.parametrize("change", list(CHANGES))
@torch.no_grad()
def test_lean_falls_back_to_transformers_with_one_warning(change, monkeypatch, caplog):
    expected = run_stream(KVStream(build("llama"), VOCAB, CPU))
    monkeypatch.setattr(lean, "_WARNED", set())
    caplog.set_level(logging.WARNING, logger=lean.__name__)
    model = build("llama")
    CHANGES[change](model, monkeypatch)
    assert change in lean.missing_internal(model)
    stream = KVStream(model, VOCAB, CPU)
    assert stream.lean is None
    for a, b in zip(run_stream(stream), expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    other = build("llama")
    CHANGES[change](other, monkeypatch)
    assert KVStream(model, VOCAB, CPU).lean is None and KVStream(other, VOCAB, CPU).lean is None
    said = lean_warnings(caplog)
    assert len(said) == 1 and change in said[0], said
    with pytest.raises(ValueError, match=change):
        lean.LeanDecoder(model)


@pytest.mark.parametrize("use_lean", [True, False])
@torch.no_grad()
def test_a_cache_layer_protocol_change_keeps_transformers_layers_with_one_warning(
    use_lean, monkeypatch, caplog
):
    """A DynamicLayer.update that keeps more state than GrowingLayer's (here a counter)."""
    model = build("llama")
    expected = run_stream(KVStream(model, VOCAB, CPU, lean=use_lean))
    update = DynamicLayer.update

    def counting_update(self, key_states, value_states, *args, **kwargs):
        self.appended = getattr(self, "appended", 0) + key_states.shape[-2]
        return update(self, key_states, value_states, *args, **kwargs)

    monkeypatch.setattr(DynamicLayer, "update", counting_update)
    monkeypatch.setattr(kv_cache, "_PROBED", [])
    caplog.set_level(logging.WARNING, logger=kv_cache.__name__)
    assert "appended" in kv_cache.growing_layer_problem()
    streams = [KVStream(model, VOCAB, CPU, lean=use_lean) for _ in range(2)]
    assert all(type(layer) is DynamicLayer for layer in streams[0].cache.layers)
    for a, b in zip(run_stream(streams[0]), expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    said = [r.getMessage() for r in caplog.records if r.name == kv_cache.__name__]
    assert len(said) == 1 and "appended" in said[0], said


@torch.no_grad()
def test_a_peft_target_gets_the_cache_without_deprecated_arguments(tiny_pair, tiny_adapter):
    from specdistill.models.hub import load_target

    model = load_target(str(tiny_pair[0]), adapter=str(tiny_adapter)).eval()
    assert hasattr(model, "get_base_model") and cache_keyword(model) == "cache"
    stream = KVStream(model, model.config.vocab_size, CPU)
    assert stream.lean is None  # peft layers: transformers' forward, with the stream's cache
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("error", FutureWarning)
        logits, _, _ = stream.admit([[5, 6, 7], [8]])
        stream.forward(torch.tensor([[3, 4], [5, 6]]), torch.ones(2, 2, dtype=torch.bool), 2)
    assert logits.shape == (2, model.config.vocab_size)
    assert stream.cache.get_seq_length() == 5
