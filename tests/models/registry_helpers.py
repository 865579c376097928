"""A tiny GGUF model and a wheel shipping it, as the registry packages ship theirs: the inputs
of the registry's tests (tests/models/test_registry*.py; the `tiny_gguf` fixture is in
conftest.py)."""

import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill.models import registry

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 20


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer)
    return tok


def tiny_model(vocab_size: int) -> LlamaForCausalLM:
    """SmolLM2's architecture, narrowed: grouped KV heads (6 over 2), tied embeddings."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (its HF converter's permutation), which readers undo."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(path: Path, model: LlamaForCausalLM, tok) -> None:
    """`model` and `tok` as llama.cpp's converter writes a Llama GGUF (float32 tensors)."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny test llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in SPECIALS else 1 for t, _ in vocab])
    merges = json.loads(tok.to_str())["model"]["merges"]  # pairs, or "a b" strings
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        for hf, ours in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if ours == "attn_q":
                t = _permute(t, c.num_attention_heads)
            elif ours == "attn_k":
                t = _permute(t, c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{ours}.weight", t)
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_wheel(folder: Path, gguf_file: Path, module: str, version: str) -> Path:
    """A minimal wheel holding `module/<gguf>`, as the registry packages ship their model."""
    dist = f"{module}-{version}"
    wheel = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf_file, f"{module}/{gguf_file.name}")
        z.writestr(f"{module}/__init__.py", "raise ImportError('never imported')\n")
        z.writestr(
            f"{dist}.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: {version}\n",
        )
        z.writestr(
            f"{dist}.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return wheel


def registry_entry(gguf_path: Path, **changes) -> registry.RegistryModel:
    fields = dict(
        package="llm-tinytest",
        version="0.1.0",
        module="llm_tinytest",
        gguf=gguf_path.name,
        sha256=hashlib.sha256(gguf_path.read_bytes()).hexdigest(),
        hub_id="example/tiny-test-llama",
        quantization="F32",
        license="Apache-2.0",
        wheel_mb=1,
    )
    return registry.RegistryModel(**fields | changes)


def installed_package(tmp_path: Path, monkeypatch, gguf_path: Path) -> None:
    """`registry:tiny-test` served by an "installed" package holding the GGUF, a private
    cache, and pip never asked."""
    site = tmp_path / "site"
    (site / "llm_tinytest").mkdir(parents=True)
    (site / "llm_tinytest" / "__init__.py").write_text("raise ImportError('not imported')\n")
    (site / "llm_tinytest" / gguf_path.name).write_bytes(gguf_path.read_bytes())
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(registry.REGISTRY, "tiny-test", registry_entry(gguf_path))
    monkeypatch.setattr(registry, "_fetch", lambda *a: pytest.fail("pip was asked"))
