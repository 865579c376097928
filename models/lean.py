"""A lean decoding forward for Llama-family causal LMs on CPU (`LeanDecoder`).

Small models decoding on a CPU are bound by per-call costs, not FLOPs: one token through a
narrow layer is some twenty small tensor ops, and transformers' modules add their own Python
work per layer. `KVStream` (models/kv_cache.py) therefore runs a supported model through
this forward instead, with the model's own parameters and the same cache:

- projections multiply by copies of the weights laid out for the number of rows, q/k/v and
  gate/up fused into one matrix each (`_Weight`, `_linear`): for one row, MKL runs `x @ Wᵀ`
  with a K-major copy faster than `F.linear(x, W)`; for two rows the widening projections
  multiply `W @ xᵀ` with the row-major weights; from PACKED_FROM rows (a verification of 2+
  drafts, a batch, a prefill) oneDNN multiplies by weights prepacked for it, which costs
  1.1-1.4 one-row steps for 3-9 rows where MKL's `x @ Wᵀ` cost 2.4-2.8;
- RoPE is applied to q and k together, with cos/sin computed once per forward by the model's
  own rotary module (so every RoPE scaling type transformers knows works as it does there);
- only the kept positions go through the final norm and the output head; their normed hidden
  state (the output head's input, transformers' `hidden_states[-1]`) comes back on request
  (`LeanDecoder.with_hidden`), for a draft's acceptance head.

Everything else is transformers' math: RMSNorm in float32 as `LlamaRMSNorm`, attention with
the module's scale and the same masks (SDPA; a batch's float32 rows of a few queries without
a causal block as two matrix products, models/attention.py), keys/values appended to the
same cache layers (a cache filled by transformers' forward continues here and the other way
round). Logits equal transformers' to float rounding (tests/models/test_lean.py).

Supported: `model_type` llama, mistral (no sliding window), qwen2 (q/k/v biases) and qwen3
(q/k norms), and a Llama draft with a reduced output vocabulary
(drafts/standalone/reduced_vocab.py, which names its model type and head class here when imported,
`support`: its K-row head runs here, its K columns then placed among the target's ids, −inf
elsewhere); SiLU MLPs, full attention in every layer, plain `nn.Linear`/`nn.Embedding` modules (no
peft adapters, no quantized layers, no accelerate hooks), on CPU, with gradients off, and at most
`MAX_WEIGHT_BYTES` (2 GiB) of weights, since the copies can more than double them (each
layout a forward has used: K-major, row-major for the fused q/k/v and gate/up, prepacked).
Anything else keeps transformers' forward: `why_not(model)` says why. Not used on GPUs, where
the weight copies would cost memory and the kernels' costs differ.

One decoder, and so one set of copies, serves every stream of a model (`decoder(model)`),
rebuilt when a parameter changes in place (its `_version` moves: an optimizer step,
`load_state_dict`) or by a new storage (`.data = ...`, `.to(dtype)`), and remade when a module
was replaced. Not seen: writes through `.data` (`p.data.add_(...)` bumps no version counter);
code that updates weights that way should set `models.lean.enabled = False`.

Internals it reads, each checked before a decoder is made (`missing_internal(model)`): the
attention modules' `scaling`, the RMSNorms' `variance_epsilon`, the rotary module called as
`rotary_emb(x, position_ids) -> (cos, sin)`, and torch's per-tensor version counter
(`Tensor._version`). When one is missing or behaves otherwise (a transformers or torch release
this module was not written for), the model keeps transformers' forward and one warning per
process names what was missing.
"""

import logging
import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from specdistill.models import attention

# The model types run here, and the output head classes besides nn.Linear: more by `support`.
_FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
_HEADS = [nn.Linear]
# Streams use the lean forward for supported models unless this is False (benchmarks turn it
# off to measure transformers' forward: `python -m benchmarks.vs_hf_assisted --no-lean`).
enabled = True
# The copies can double the weights' memory: larger models keep transformers' forward.
MAX_WEIGHT_BYTES = 2 << 30

log = logging.getLogger(__name__)
_WARNED: set[str] = set()  # internals already named in a warning (one warning each per process)


def support(model_type: str, head: type[nn.Linear] | None = None) -> None:
    """Run `model_type` here too: a causal LM with Llama's modules whose output head is a plain
    `nn.Linear` or a `head` (a subclass of it whose `to_target_vocab(logits)` places its columns
    among the target's ids). A draft type with a model class of its own calls this on import
    (drafts/standalone/reduced_vocab.py), as it registers the class with transformers."""
    if model_type not in _FAMILIES:
        _FAMILIES.append(model_type)
    if head is not None and head not in _HEADS:
        _HEADS.append(head)


def why_not(model) -> str | None:
    """None when `LeanDecoder` can run `model`, else the reason it cannot."""
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in _FAMILIES:
        return f"model_type {family!r} is not one of {tuple(_FAMILIES)}"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "rotary_emb") or not hasattr(base, "layers"):
        return "no model.model.layers / rotary_emb"
    if any(p.device.type != "cpu" for p in model.parameters()):
        return "not on CPU"
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if size > MAX_WEIGHT_BYTES:
        return f"weights of {size / 2**30:.1f} GiB: copies would double that (MAX_WEIGHT_BYTES)"
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "pretraining_tp", 1) != 1:
        return "hidden_act is not silu or pretraining_tp != 1"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or (
        family == "mistral" and getattr(config, "sliding_window", None) is not None
    ):
        return "sliding-window layers"
    if type(base.embed_tokens) is not nn.Embedding:
        return "the embedding is not a plain nn.Embedding"
    if type(model.lm_head) not in _HEADS:
        return "the output head is not a plain nn.Linear (adapter, quantized layer)"
    linears = []
    for layer in base.layers:
        a, m = layer.self_attn, layer.mlp
        linears += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
    if any(type(x) is not nn.Linear for x in linears):
        return "a projection is not a plain nn.Linear (adapter, quantized layer)"
    if any(hasattr(x, "_hf_hook") for x in model.modules()):
        return "accelerate hooks (device_map offloading)"
    return None


def _version_of(p: torch.Tensor) -> int:
    """torch's in-place version counter of `p` (0 for inference tensors, which keep none)."""
    return 0 if p.is_inference() else p._version


def _norms(model) -> list[tuple[str, nn.Module]]:
    base = model.model
    found = [("model.norm", base.norm)]
    for i, layer in enumerate(base.layers):
        a = layer.self_attn
        found += [
            (f"layers[{i}].input_layernorm", layer.input_layernorm),
            (f"layers[{i}].post_attention_layernorm", layer.post_attention_layernorm),
        ]
        found += [(f"layers[{i}].self_attn.{n}", getattr(a, n, None)) for n in ("q_norm", "k_norm")]
    return [(name, norm) for name, norm in found if norm is not None]


def missing_internal(model) -> str | None:
    """None when every internal attribute the lean forward reads is there and behaves as
    expected on `model` (a model `why_not` accepts), else what is missing."""
    params = list(model.parameters())
    first = params[0]
    if not first.is_inference() and not isinstance(getattr(first, "_version", None), int):
        return "torch's Tensor._version (the in-place version counter)"
    for i, layer in enumerate(model.model.layers):
        if not isinstance(getattr(layer.self_attn, "scaling", None), (int, float)):
            return f"the attention module's `scaling` (layers[{i}].self_attn.scaling)"
    for name, norm in _norms(model):
        eps = getattr(norm, "variance_epsilon", None)
        if not isinstance(eps, (int, float)) or not isinstance(norm.weight, torch.Tensor):
            return f"the RMSNorm's `variance_epsilon` / `weight` ({name})"
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    x = params[0].new_zeros(1, 1, c.hidden_size)
    try:
        with torch.no_grad():
            cos, sin = model.model.rotary_emb(x, torch.zeros(1, 1, dtype=torch.long))
        if cos.shape != (1, 1, head_dim) or sin.shape != (1, 1, head_dim):
            raise ValueError(f"shapes {tuple(cos.shape)}, {tuple(sin.shape)}")
    except (TypeError, ValueError, AttributeError, RuntimeError) as e:
        return f"the rotary module's forward(x, position_ids) -> (cos, sin) ({e})"
    return None


def _warn_once(what: str) -> None:
    if what not in _WARNED:
        _WARNED.add(what)
        log.warning(
            "models.lean: %s is missing or changed in this transformers/torch; "
            "such models keep transformers' forward",
            what,
        )


# One decoder (one set of weight copies) per model, shared by all its streams and engines;
# the models whose internals were found missing, with their parameters' ids when checked.
_SHARED: "weakref.WeakKeyDictionary[nn.Module, LeanDecoder]" = weakref.WeakKeyDictionary()
_REFUSED: "weakref.WeakKeyDictionary[nn.Module, list[int]]" = weakref.WeakKeyDictionary()


def decoder(model) -> "LeanDecoder | None":
    """`model`'s shared LeanDecoder, or None when `why_not(model)` gives a reason or an internal
    the forward reads is missing (`missing_internal`: warned once). A new one when the model's
    parameters are other objects than before (a module was replaced)."""
    if why_not(model):
        return None
    ids = [id(p) for p in model.parameters()]
    if _REFUSED.get(model) == ids:
        return None
    shared = _SHARED.get(model)
    if shared is None or ids != shared.param_ids:
        missing = missing_internal(model)
        if missing:
            _warn_once(missing)
            _REFUSED[model] = ids
            return None
        shared = _SHARED[model] = LeanDecoder(model, checked=True)
    return shared


# Which kernel multiplies a forward's rows by a weight (measured on one x86 core with the 30
# layers of SmolLM2-135M's shapes, 1 thread: benchmarks/verify_cost.py):
# - 1 row: `x @ Wᵀ` with a K-major copy of W (MKL's fastest one-row kernel);
# - 2..FEW_ROWS rows (below PACKED_FROM), widening projections: `W @ xᵀ` with W row-major,
#   about one row's time where MKL's small-M `x @ Wᵀ` costs 1.5-2×;
# - PACKED_FROM rows and more: oneDNN's linear on a copy of W prepacked for it
#   (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`): a verification of 3-9
#   rows then costs 1.1-1.4 one-row steps, where MKL's `x @ Wᵀ` cost 2.4-2.75 beyond 4 rows.
#   Row i of a k-row product is bitwise the same for every k >= PACKED_FROM
#   (tests/models/test_lean.py): what verification scores for a drafted token does not depend
#   on how many were drafted. Without oneDNN's ops (`packed_ops()`) or for a dtype they cannot
#   pack, those rows take `x @ Wᵀ`.
# - 2 rows in float32: the row-major product wins on some CPUs (avx512) and not on others (an
#   avx2 AMD EPYC: 1.75 steps, 1.36 prepacked): the first float32 forward of a process times
#   both on a probe (under 0.1 s) and keeps the faster (`two_rows_packed`).
# - bfloat16 and float16 weights: prepacked at every row count (`packed_from`), the fastest
#   one-row kernel for every shape measured (benchmarks/RESULTS.md); the target alone and its
#   verification passes then score a row bitwise alike.
# Each layout is made on its first use, so a model holds only the copies its forwards use.
FEW_ROWS = 4
PACKED_FROM = 3
HALF = (torch.bfloat16, torch.float16)
_PACKED_OPS: list[bool] = []  # packed_ops()'s answer, once per process


def _pack(w: torch.Tensor) -> torch.Tensor:
    """W [out, in] prepacked for oneDNN's linear (batch size hint 8)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, 8)


def _packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    """x [..., in] times a `_pack`ed W, plus bias: oneDNN's prepacked linear."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_TWO_ROWS: list[bool] = []  # two_rows_packed()'s answer, once per process
PROBE = (1536, 576)  # [out, in] of the probe: SmolLM2-135M's up projection


def two_rows_packed() -> bool:
    """Whether 2-row float32 products take the prepacked kernel: measured once per process,
    the two kernels taking turns on a PROBE-shaped weight (median of 25 calls each), the
    prepacked one chosen only when it is at least 10% faster."""
    if not _TWO_ROWS:
        faster = False
        if packed_ops():
            w, x = torch.randn(*PROBE), torch.randn(2, PROBE[1])
            packed = _pack(w)
            kernels = (lambda: (w @ x.t()).t(), lambda: _packed_product(x, packed, None))
            times: list[list[float]] = [[], []]
            with torch.no_grad():
                for _ in range(25):
                    for i, kernel in enumerate(kernels):
                        start = time.perf_counter()
                        kernel()
                        times[i].append(time.perf_counter() - start)
            rows, prepacked = (sorted(t)[len(t) // 2] for t in times)
            faster = prepacked < 0.9 * rows
        _TWO_ROWS.append(faster)
    return _TWO_ROWS[0]


def packed_ops() -> bool:
    """Whether this torch has oneDNN's prepacked linear ops and they agree with `x @ Wᵀ`."""
    if not _PACKED_OPS:
        ok = False
        try:
            if torch.backends.mkldnn.is_available():
                w, x = torch.randn(8, 4), torch.randn(3, 4)
                y = _packed_product(x, _pack(w), None)
                ok = bool(torch.allclose(y, x @ w.t(), rtol=1e-4, atol=1e-5))
        except (AttributeError, RuntimeError, NotImplementedError):
            ok = False
        _PACKED_OPS.append(ok)
    return _PACKED_OPS[0]


class _Weight:
    """One projection's fused weight [out, in] and its kernel layouts, each made on first use:
    K-major `t` [in, out] for one row, row-major `rows` for 2..FEW_ROWS rows of a widening
    projection (out >= in: q/k/v, gate/up, the output head; for the narrowing down projection
    that kernel cost 3× one row at 2 rows), and oneDNN's prepacked copy from PACKED_FROM rows."""

    __slots__ = ("_layouts", "w", "widening")

    def __init__(self, *weights: torch.Tensor):
        """[out_1 + out_2 + ..., in] weights -> one fused matrix (the parameter itself when
        alone and contiguous: no copy)."""
        w = (torch.cat(weights) if len(weights) > 1 else weights[0]).detach()
        self.w = w.contiguous()
        self.widening = w.shape[0] >= w.shape[1]
        self._layouts: dict[str, torch.Tensor | None] = {}

    def layout(self, name: str) -> torch.Tensor | None:
        """The weight in layout `name` ("t", "rows", "packed"); None when it cannot be made."""
        if name not in self._layouts:
            with torch.no_grad():
                self._layouts[name] = self._make(name)
        return self._layouts[name]

    def _make(self, name: str) -> torch.Tensor | None:
        if name == "t":
            return self.w.t().contiguous()
        if name == "rows":
            return self.w
        if not packed_ops():
            return None
        try:
            return _pack(self.w)
        except (RuntimeError, NotImplementedError):  # a dtype oneDNN cannot pack on this CPU
            return None

    def made(self) -> list[str]:
        """The layouts made so far (their copies are what this weight costs beyond itself)."""
        return [name for name, t in self._layouts.items() if t is not None]


def _bias(*linears: nn.Linear) -> torch.Tensor | None:
    if all(x.bias is None for x in linears):
        return None
    return torch.cat(
        [x.bias if x.bias is not None else x.weight.new_zeros(x.out_features) for x in linears]
    )


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, scale in the input dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def packed_from(dtype: torch.dtype) -> int:
    """The fewest rows a forward multiplies by prepacked weights of `dtype` (0: never)."""
    if not PACKED_FROM:
        return 0
    if dtype in HALF:
        return 1
    return 2 if PACKED_FROM > 2 and two_rows_packed() else PACKED_FROM


def _linear(x: torch.Tensor, weight: _Weight, bias: torch.Tensor | None) -> torch.Tensor:
    n = x.numel() // x.shape[-1]
    start = packed_from(weight.w.dtype)
    if start and n >= start:
        packed = weight.layout("packed")
        if packed is not None:
            return _packed_product(x, packed, bias)
    if 1 < n <= FEW_ROWS and weight.widening:
        rows = weight.layout("rows")
        y = (rows @ x.reshape(n, x.shape[-1]).t()).t().reshape(*x.shape[:-1], -1)
    else:
        y = x @ weight.layout("t")
    return y if bias is None else y + bias


def additive_mask(mask: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Key mask [B, L] whose last k columns are this forward's tokens -> additive [B, 1, k, L].

    Query i sees every valid earlier key and the new keys j <= i that are valid; it always sees
    itself, so a padding query never has all keys masked (its output is unused).
    """
    b, length = mask.shape
    new = torch.ones(k, k, dtype=torch.bool, device=mask.device)
    allowed = torch.cat(
        [
            mask[:, None, : length - k].expand(b, k, length - k),
            (mask[:, None, length - k :] & new.tril()) | new.diag().diag_embed(),
        ],
        dim=2,
    )
    out = torch.zeros(b, 1, k, length, dtype=dtype, device=mask.device)
    return out.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


class _Layer:
    """One decoder layer's weights, prepared."""

    def __init__(self, layer):
        a, m = layer.self_attn, layer.mlp
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv, self.qkv_bias = (
            _Weight(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight),
            _bias(a.q_proj, a.k_proj, a.v_proj),
        )
        self.o, self.o_bias = _Weight(a.o_proj.weight), a.o_proj.bias
        self.gate_up = _Weight(m.gate_proj.weight, m.up_proj.weight)
        self.gate_up_bias = _bias(m.gate_proj, m.up_proj)
        self.down, self.down_bias = _Weight(m.down_proj.weight), m.down_proj.bias
        self.q_norm, self.k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        self.scaling = a.scaling
        self.ff = m.gate_proj.out_features


class LeanDecoder:
    """`model`'s decoding forward without transformers' modules (see the module docstring)."""

    def __init__(self, model, checked: bool = False):
        reason = None if checked else (why_not(model) or missing_internal(model))
        if reason:
            raise ValueError(f"LeanDecoder cannot run this model: {reason}")
        # Submodules only, never `model` itself: the shared table holds models weakly.
        self.base, self.lm_head = model.model, model.lm_head
        # A reduced head's K columns -> the target's ids (drafts/standalone/reduced_vocab.py),
        # else None.
        self.to_target = getattr(self.lm_head, "to_target_vocab", None)
        c = model.config
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self._params = list(model.parameters())
        self.param_ids = [id(p) for p in self._params]
        self._state = None

    def _prepare(self) -> None:
        """(Re)build the copies when a parameter changed: in place (its version counter) or
        through `.data` / `.to()` (its storage). Inference tensors keep no version counter."""
        state = [(_version_of(p), p.data_ptr()) for p in self._params]
        if state == self._state:
            return
        with torch.no_grad():
            self.layers = [_Layer(layer) for layer in self.base.layers]
            self.head = _Weight(self.lm_head.weight)
            self.head_bias = self.lm_head.bias
            self.dtype = self.lm_head.weight.dtype
        self._state = state

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache,
        key_mask: torch.Tensor,
        keep: int,
        record=None,
    ) -> torch.Tensor:
        """Append tokens [B, k] at positions [B, k] to `cache` -> logits [B, keep, V] of the last
        `keep` positions. key_mask [B, L]: the valid keys, cached ones and these k last.

        record(i, hidden): called with the residual stream entering layer i (EAGLE-3 features).
        """
        return self.with_hidden(tokens, positions, cache, key_mask, keep, record)[0]

    def with_hidden(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache,
        key_mask: torch.Tensor,
        keep: int,
        record=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `__call__`, -> (logits [B, keep, V], hidden [B, keep, H]): the final norm's output
        at the kept positions, which is what the output head reads (transformers'
        `hidden_states[-1]`). The forward computes it anyway: asking for it costs nothing."""
        self._prepare()
        k, length = tokens.shape[1], key_mask.shape[1]
        if bool(key_mask.all()) and (k == 1 or length == k):
            mask, causal = None, k > 1  # one token, or a prefill: SDPA's unmasked paths
        else:
            mask, causal = additive_mask(key_mask, k, self.dtype), False
        base = self.base
        b = tokens.shape[0]
        nh, nkv, d = self.heads, self.kv_heads, self.head_dim
        x = base.embed_tokens(tokens)
        cos, sin = base.rotary_emb(x, positions)
        # rotate_half(t) * sin == flip of t's halves * (sin with its first half negated)
        half = d // 2
        cos, sin = cos[:, :, None], torch.cat([-sin[..., :half], sin[..., half:]], -1)[:, :, None]
        gqa = nkv != nh
        few = attention.applies(b, k, causal, self.dtype)
        for i, w in enumerate(self.layers):
            if record is not None:
                record(i, x)
            h = _rms(x, w.ln1.weight, w.ln1.variance_epsilon)
            qkv = _linear(h, w.qkv, w.qkv_bias).view(b, k, nh + 2 * nkv, d)
            q, key, value = qkv.split([nh, nkv, nkv], dim=2)
            if w.q_norm is not None:
                q = _rms(q, w.q_norm.weight, w.q_norm.variance_epsilon)
                key = _rms(key, w.k_norm.weight, w.k_norm.variance_epsilon)
                qk = torch.cat([q, key], dim=2)
            else:
                qk = qkv[:, :, : nh + nkv]
            qk = qk * cos + qk.view(b, k, nh + nkv, 2, half).flip(3).view(qk.shape) * sin
            q, key = qk.transpose(1, 2).split([nh, nkv], dim=1)
            key, value = cache.layers[i].update(key, value.transpose(1, 2))
            if few:
                o = attention.few_rows_attention(q, key, value, mask, w.scaling)
            else:
                o = F.scaled_dot_product_attention(
                    q, key, value, attn_mask=mask, is_causal=causal, scale=w.scaling, enable_gqa=gqa
                )
            x = x + _linear(o.transpose(1, 2).reshape(b, k, nh * d), w.o, w.o_bias)
            h = _rms(x, w.ln2.weight, w.ln2.variance_epsilon)
            gate, up = _linear(h, w.gate_up, w.gate_up_bias).split(w.ff, dim=-1)
            x = x + _linear(F.silu(gate) * up, w.down, w.down_bias)
        norm = base.norm
        x = _rms(x[:, -keep:], norm.weight, norm.variance_epsilon)
        logits = _linear(x, self.head, self.head_bias)
        return (logits if self.to_target is None else self.to_target(logits)), x
