"""The lean CPU decoding forward (models/lean.py): logits equal transformers' for every supported
family through a stream's prefill, padding, holes and verification passes; when it is used and
when transformers' forward is kept; weights changed in place; EAGLE-3 feature capture."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM

from specdistill.drafts.eagle3.head import FeatureCapture
from specdistill.models import lean
from specdistill.models.kv_cache import KVStream
from tests.models.helpers import FAMILIES, SIZES, VOCAB, build, run_stream


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_logits_equal_transformers(family):
    model = build(family)
    assert lean.why_not(model) is None
    fast = KVStream(model, VOCAB, torch.device("cpu"))
    plain = KVStream(model, VOCAB, torch.device("cpu"), lean=False)
    assert fast.lean is not None and plain.lean is None
    for a, b in zip(run_stream(fast), run_stream(plain), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "llama-smollm2-shape"])
@torch.no_grad()
def test_one_row_verification_of_every_length_equals_transformers(family):
    """Batch 1 after a prefill, k = 1..9 new tokens (a round's verification up to γ = 8):
    the K-major kernel for one row, the row-major one for two, oneDNN's prepacked one from
    three, with grouped KV heads under a causal mask."""
    model = build(family)
    fast = KVStream(model, VOCAB, torch.device("cpu"))
    plain = KVStream(model, VOCAB, torch.device("cpu"), lean=False)
    prefix = [[3, 1, 4, 1, 5, 9, 2, 6]]
    torch.testing.assert_close(fast.admit(prefix)[0], plain.admit(prefix)[0], rtol=1e-5, atol=1e-5)
    for k in range(1, 10):
        tokens = torch.arange(k).view(1, k) + 10
        valid = torch.ones(1, k, dtype=torch.bool)
        a, b = fast.forward(tokens, valid, keep=k), plain.forward(tokens, valid, keep=k)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for stream in (fast, plain):
            stream.drop_last(torch.tensor([k]))


@pytest.mark.skipif(not lean.packed_ops(), reason="this torch has no oneDNN prepacked linear")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_prepacked_rows_do_not_depend_on_how_many_share_the_forward(dtype):
    """Row i of a product of k >= packed_from(dtype) rows is bitwise the same for every k: what
    verification scores for a drafted token does not depend on how many were drafted. In
    bfloat16 that holds from one row: a decoding step of the target alone scores a position
    as its verification does."""
    torch.manual_seed(0)
    weight = lean._Weight(torch.randn(160, 64, dtype=dtype), torch.randn(32, 64, dtype=dtype))
    bias = torch.randn(192, dtype=dtype)
    x = torch.randn(1, 12, 64, dtype=dtype)
    if weight.layout("packed") is None:  # e.g. bfloat16 on a CPU without avx512bw/vl/dq
        pytest.skip(f"oneDNN cannot prepack {dtype} on this CPU: those rows take x @ Wᵀ")
    full = lean._linear(x, weight, bias)
    torch.testing.assert_close(full.float(), (x @ weight.w.t() + bias).float(), **_close(dtype))
    start = lean.packed_from(dtype)
    two = 2 if lean.two_rows_packed() else lean.PACKED_FROM
    assert start == (1 if dtype == torch.bfloat16 else two)
    for k in range(start, 12):
        assert torch.equal(lean._linear(x[:, :k], weight, bias), full[:, :k])
    assert weight.made() == ["packed"]


@pytest.mark.parametrize("faster", [True, False])
def test_two_float32_rows_take_the_kernel_measured_faster(monkeypatch, faster):
    """Where the prepacked kernel measured faster at 2 rows, 2-row float32 forwards take it
    (and their rows are then bitwise those of longer products); else the row-major layout."""
    if not lean.packed_ops():
        pytest.skip("oneDNN's prepacked ops are missing here")
    monkeypatch.setattr(lean, "_TWO_ROWS", [faster])
    assert lean.packed_from(torch.float32) == (2 if faster else lean.PACKED_FROM)
    torch.manual_seed(0)
    weight = lean._Weight(torch.randn(96, 32))
    x = torch.randn(1, 6, 32)
    two = lean._linear(x[:, :2], weight, None)
    assert weight.made() == (["packed"] if faster else ["rows"])
    if faster:
        assert torch.equal(two, lean._linear(x, weight, None)[:, :2])
    torch.testing.assert_close(two, x[:, :2] @ weight.w.t(), rtol=1e-5, atol=1e-5)


def test_the_two_row_measurement_is_made_once_and_needs_the_ops(monkeypatch):
    monkeypatch.setattr(lean, "_TWO_ROWS", [])
    monkeypatch.setattr(lean, "_PACKED_OPS", [False])
    assert lean.two_rows_packed() is False
    monkeypatch.setattr(lean, "_PACKED_OPS", [True])
    assert lean.two_rows_packed() is False  # kept for the process: a forward's kernel is stable


def _close(dtype) -> dict:
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.05)


@torch.no_grad()
def test_a_model_holds_only_the_layouts_its_forwards_used(monkeypatch):
    """A one-token prompt and a decoding step make the K-major copies alone; a verification
    of 3+ rows adds the prepacked ones; without oneDNN's ops (`packed_ops` False) those rows
    take the K-major kernel, and the logits still equal transformers'."""
    model = build("llama-smollm2-shape")
    plain = KVStream(model, VOCAB, torch.device("cpu"), lean=False)
    prefix = [[3]]
    plain.admit(prefix)
    for ops in ([True], [False]) if lean.packed_ops() else ([False],):
        monkeypatch.setattr(lean, "_PACKED_OPS", ops)
        lean._SHARED.pop(model, None)
        fast = KVStream(model, VOCAB, torch.device("cpu"))
        fast.admit(prefix)
        layers = fast.lean.layers
        one = torch.tensor([[7]])
        torch.testing.assert_close(
            fast.forward(one, one > 0, keep=1), plain.forward(one, one > 0, keep=1)
        )
        assert {tuple(w.made()) for w in (layers[0].qkv, layers[0].down, fast.lean.head)} == {
            ("t",)
        }
        five = torch.arange(5).view(1, 5) + 10
        valid = torch.ones(1, 5, dtype=torch.bool)
        torch.testing.assert_close(
            fast.forward(five, valid, keep=5),
            plain.forward(five, valid, keep=5),
            rtol=1e-5,
            atol=1e-5,
        )
        assert ("packed" in layers[0].qkv.made()) == ops[0]
        for stream in (fast, plain):
            stream.drop_last(torch.tensor([6]))


@torch.no_grad()
def test_bfloat16_matches_transformers_to_its_precision():
    model = build("llama").to(torch.bfloat16)
    fast = KVStream(model, VOCAB, torch.device("cpu"))
    plain = KVStream(model, VOCAB, torch.device("cpu"), lean=False)
    for a, b in zip(run_stream(fast), run_stream(plain), strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.1)


def test_unsupported_models_keep_transformers_forward(monkeypatch):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2))
    sliding = MistralForCausalLM(MistralConfig(**SIZES, sliding_window=8))
    adapted = get_peft_model(build("llama"), LoraConfig(r=2, target_modules=["q_proj"]))
    merged_later = build("llama")
    merged_later.model.layers[0].mlp.up_proj = torch.nn.Sequential(
        merged_later.model.layers[0].mlp.up_proj
    )
    reasons = {
        "gpt2": lean.why_not(gpt2),
        "sliding": lean.why_not(sliding),
        "peft": lean.why_not(adapted),
        "wrapped": lean.why_not(merged_later),
        "peft base": lean.why_not(adapted.get_base_model()),
    }
    assert "model_type 'gpt2'" in reasons["gpt2"]
    assert reasons["sliding"] == "sliding-window layers"
    assert reasons["peft"] is not None and "plain nn.Linear" in reasons["peft base"]
    assert "plain nn.Linear" in reasons["wrapped"]
    assert KVStream(gpt2, VOCAB, torch.device("cpu")).lean is None
    monkeypatch.setattr(lean, "MAX_WEIGHT_BYTES", 1000)
    assert "copies would double that" in lean.why_not(build("llama"))
    with pytest.raises(ValueError, match="cannot run this model: model_type 'gpt2'"):
        lean.LeanDecoder(gpt2)


def test_gradients_on_use_transformers_forward(monkeypatch):
    """Training code that streams with gradients (none does today) gets a differentiable pass."""

    def refuse(*args, **kwargs):
        raise AssertionError("the lean forward ran with gradients on")

    model = build("llama")
    stream = KVStream(model, VOCAB, torch.device("cpu"))
    assert stream.lean is not None
    monkeypatch.setattr(lean.LeanDecoder, "__call__", refuse)
    logits = stream.admit([[5, 6, 7]])[0]
    assert logits.requires_grad


@torch.no_grad()
def test_changed_weights_are_picked_up_by_the_shared_decoder():
    """Between two evaluations: an optimizer-style in-place step, a new storage through `.data`,
    a replaced module. Streams of one model share one decoder until a module is replaced."""
    model = build("llama")

    def both():
        fast = KVStream(model, VOCAB, torch.device("cpu"))
        plain = KVStream(model, VOCAB, torch.device("cpu"), lean=False)
        a, b = run_stream(fast)[-1], run_stream(plain)[-1]
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        return fast.lean, a

    first, before = both()
    for change in (
        lambda: model.model.layers[1].mlp.down_proj.weight.mul_(3.0),
        lambda: setattr(model.lm_head.weight, "data", model.lm_head.weight.data + 0.1),
    ):
        change()
        decoder, after = both()
        assert decoder is first and not torch.allclose(after, before)
        before = after
    torch.manual_seed(1)
    model.model.layers[0].self_attn.o_proj = torch.nn.Linear(64, 64, bias=False)
    decoder, after = both()
    assert decoder is not first and not torch.allclose(after, before)


def test_the_shared_decoder_does_not_keep_its_model_alive():
    import gc

    model = build("llama")
    assert lean.decoder(model) is lean.decoder(model)
    assert len(lean._SHARED) >= 1
    ref = __import__("weakref").ref(model)
    del model
    gc.collect()
    assert ref() is None


@torch.no_grad()
def test_eagle3_features_are_recorded_as_hooks_capture_them():
    model = build("llama")
    streams = [
        KVStream(model, VOCAB, torch.device("cpu"), FeatureCapture(model, [0, 1]), lean=use)
        for use in (True, False)
    ]
    assert streams[0].lean is not None and streams[1].lean is None
    features = []
    for s in streams:
        s.admit([[5, 6, 7], [8]])
        tokens, valid = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.ones(2, 3, dtype=torch.bool)
        s.forward(tokens, valid, keep=1)
        features.append(s.features)
    assert features[0].shape == (2, 3, 2 * 64)
    torch.testing.assert_close(features[0], features[1], rtol=1e-5, atol=1e-5)
