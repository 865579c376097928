"""The transformers/torch internals drafts/lean.py and drafts/kv_cache.py read: present in the
installed versions; when one is missing (as in a release they were not written for), the
stream keeps transformers' forward / transformers' own cache layers, gives the same logits,
and one warning names what was missing. A peft-wrapped model gets the cache as `cache`."""

import logging
import warnings

import pytest
import torch
from transformers.cache_utils import DynamicLayer
from transformers.models.llama.modeling_llama import LlamaAttention

from specdistill.drafts import kv_cache, lean
from specdistill.drafts.kv_cache import GrowingLayer, KVStream, cache_keyword
from tests.drafts.test_lean import VOCAB, build, run_stream

CPU = torch.device("cpu")


class RenamedNorm(torch.nn.Module):
    """An RMSNorm whose epsilon is called `eps` (the same math as LlamaRMSNorm)."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        )


class RenamedScaling(LlamaAttention):
    """An attention module that keeps its softmax scale as `softmax_scale`."""

    def forward(self, *args, **kwargs):
        self.scaling = self.softmax_scale
        try:
            return super().forward(*args, **kwargs)
        finally:
            del self.scaling


class KeywordRotary(torch.nn.Module):
    """The model's rotary module, called with `position_ids` as a keyword only."""

    def __init__(self, rotary):
        super().__init__()
        self.inner = rotary

    def forward(self, x, *, position_ids):
        return self.inner(x, position_ids)


def rename_norms(model, monkeypatch):
    base = model.model
    base.norm = RenamedNorm(base.norm)
    for layer in base.layers:
        layer.input_layernorm = RenamedNorm(layer.input_layernorm)
        layer.post_attention_layernorm = RenamedNorm(layer.post_attention_layernorm)


def rename_scaling(model, monkeypatch):
    for layer in model.model.layers:
        a = layer.self_attn
        a.softmax_scale = a.scaling
        del a.scaling
        a.__class__ = RenamedScaling


def keyword_rotary(model, monkeypatch):
    model.model.rotary_emb = KeywordRotary(model.model.rotary_emb)


def no_version_counter(model, monkeypatch):
    def missing(self):
        raise AttributeError("_version")

    monkeypatch.setattr(torch.nn.Parameter, "_version", property(missing), raising=False)


CHANGES = {
    "variance_epsilon": rename_norms,
    "scaling": rename_scaling,
    "rotary": keyword_rotary,
    "_version": no_version_counter,
}


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
    from specdistill.drafts.hub import load_target

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
