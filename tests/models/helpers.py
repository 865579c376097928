"""Models for the lean decoder's tests: one tiny random model of each family models/lean.py
supports (`build`), a stream run through a ragged prefill, a padded token and rolled-back
tails (`run_stream`), and each transformers/torch internal the lean decoder reads, changed on
a model as a release it was not written for might change it (`CHANGES`)."""

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.llama.modeling_llama import LlamaAttention

from specdistill.models.kv_cache import KVStream

VOCAB = 96


SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 10000.0,
}


FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SIZES)),
    "llama-mha-tied": lambda: LlamaForCausalLM(
        LlamaConfig(**SIZES | {"num_key_value_heads": 4}, tie_word_embeddings=True)
    ),
    # SmolLM2-135M's shape, narrowed: 9 query heads over 3 KV heads, tied embeddings.
    "llama-smollm2-shape": lambda: LlamaForCausalLM(
        LlamaConfig(
            **SIZES | {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 72},
            tie_word_embeddings=True,
        )
    ),
    "llama3-rope-biases": lambda: LlamaForCausalLM(
        LlamaConfig(**SIZES, rope_parameters=LLAMA3_ROPE, attention_bias=True, mlp_bias=True)
    ),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SIZES, sliding_window=None)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SIZES)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SIZES, head_dim=24)),
}


def build(family: str):
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    with torch.no_grad():  # random biases and norm weights, so that they are exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def run_stream(stream: KVStream, seed: int = 0) -> list[torch.Tensor]:
    """Ragged prefill, then chunks with a padded token and rolled-back tails (holes)."""
    out = [stream.admit([[5, 6, 7, 9], [8]])[0]]
    g = torch.Generator().manual_seed(seed)
    for k, valid_first in [(4, True), (1, True), (3, False), (5, True), (1, False)]:
        tokens = torch.randint(0, VOCAB, (2, k), generator=g)
        valid = torch.ones(2, k, dtype=torch.bool)
        valid[1, 0] = valid_first
        out.append(stream.forward(tokens, valid, keep=k)[valid])
        stream.drop_last(torch.tensor([k - 1, 0]))
    return out


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
