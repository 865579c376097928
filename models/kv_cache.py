"""A model's decoding state for a batch of rows: KV cache, key mask and position ids.

The speculative decoding engine (eval/engine.py) keeps one `KVStream` for the target and
one inside each drafter (drafts/standalone/, drafts/eagle3/).

Batching (per-sequence acceptance). A stream holds one `DynamicCache` for the batch plus a
2-D key mask [batch, cache_len] and the next position id per row. Rows are right-aligned
(left padding). Tokens that a row rejects are *masked*, not moved: the common tail that every
row rejected is cropped off, the rest become masked holes, and position ids (passed
explicitly, = number of valid tokens before) stay exact, so holes change nothing but the
work done. When holes and padding exceed `_COMPACT_FRACTION` of the cache, one gather per
layer right-aligns every row again. This keeps each row's acceptance independent of the
others (no rollback to the batch minimum). Rows joining a running batch (continuous
batching) are prefilled in their own forward pass and their caches join the batch's,
left-padded; rows of very different prompt lengths are prefilled in groups of similar length
(`length_groups`), so that a prefill computes few padding tokens.

Speed (CPU decoding is bound by per-call costs, not FLOPs). A supported Llama-family model on
CPU runs models/lean.py's forward instead of transformers' (same weights, same cache, same
logits to float rounding). Each cache layer appends into
spare capacity (`GrowingLayer`) instead of concatenating the whole cache every step, and a
multi-token forward on a filled cache (the target's verification pass) gets a prepared
additive 4-D mask instead of one transformers builds as booleans, which SDPA converts again in
every layer (`additive_mask`).

`GrowingLayer` reimplements `DynamicLayer.update` of transformers' cache-layer protocol. Before
the first cache is made, a probe checks that it leaves a layer in the state `DynamicLayer`
would (same attributes, same keys/values, same length, same after `reset`); when it does not
(a transformers release this module was not written for), caches keep transformers' own
layers and one warning per process names the difference.

The cache goes to the model as its `cache` argument (transformers ≥ 5), read from the forward
signature of the model or, for a peft-wrapped one, of the model inside it (peft passes it on).
"""

import inspect
import logging
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from specdistill.models import lean as lean_forward
from specdistill.models.lean import additive_mask

# Compact (gather) a cache once padding + holes exceed this fraction of its length.
_COMPACT_FRACTION = 0.25
# Spare positions a cache layer allocates when it must grow: max(_MIN_SPARE, length / 4).
_MIN_SPARE = 256
# Attention implementations that take an additive 4-D float mask as it is.
_ADDITIVE_MASK_ATTENTION = ("sdpa", "eager")

log = logging.getLogger(__name__)


def cache_keyword(model) -> str:
    """transformers ≥ 5 names the cache argument `cache`; 4.x named it `past_key_values`.

    A peft model's own forward takes `**kwargs` and hands them to the model it wraps, so the
    name is read from that model's forward.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(inner.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that wall-clock timings are real."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def eval_mode(*models):
    """Switch the models (None skipped) to eval mode for the block; restore their modes."""
    modes = [(m, m.training) for m in models if m is not None]
    for m, _ in modes:
        m.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.train(training)


class GrowingLayer(DynamicLayer):
    """A DynamicLayer that appends into spare capacity of a buffer instead of `torch.cat`.

    `keys`/`values` stay plain tensors (views of the buffers), so the stream's slicing, gathers
    and row selections work on them unchanged; a tensor that is no longer a prefix of its buffer
    (after a gather, say) is copied into a new buffer on the next append.
    """

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        self.buffers = {}

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = self._append("keys", key_states)
        self.values = self._append("values", value_states)
        return self.keys, self.values

    def _append(self, name: str, new: torch.Tensor) -> torch.Tensor:
        old, buffer = getattr(self, name), self.buffers.get(name)
        n, k = (old.shape[2] if old.dim() == 4 else 0), new.shape[2]
        if not (
            buffer is not None
            and old.dim() == 4
            and old.data_ptr() == buffer.data_ptr()
            and old.stride() == buffer.stride()
            and old.shape[:2] == buffer.shape[:2] == new.shape[:2]
            and n + k <= buffer.shape[2]
        ):
            spare = max(_MIN_SPARE, (n + k) // 4)
            buffer = new.new_empty(new.shape[0], new.shape[1], n + k + spare, new.shape[3])
            if n:
                buffer[:, :, :n].copy_(old)
            self.buffers[name] = buffer
        buffer[:, :, n : n + k].copy_(new)
        return buffer[:, :, : n + k]

    def reset(self) -> None:
        self.buffers = {}
        super().reset()


def _state(layer) -> dict:
    return {k: v for k, v in vars(layer).items() if k != "buffers"}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    return type(a) is type(b) and a == b


def growing_layer_problem() -> str | None:
    """None when `GrowingLayer` leaves a layer as `DynamicLayer` does after appends of several
    lengths and a reset, else the first difference (or the error the probe raised)."""
    plain, growing = DynamicLayer(), GrowingLayer()
    try:
        for step, k in enumerate((3, 1, 2, 300)):
            key = torch.arange(2 * 2 * k * 4, dtype=torch.float32).view(2, 2, k, 4) + step
            for layer in (plain, growing):
                out = layer.update(key, -key)
            if not (_same(out[0], plain.keys) and _same(out[1], plain.values)):
                return f"update's returned keys/values after {step + 1} appends"
            if growing.get_seq_length() != plain.get_seq_length():
                return f"get_seq_length() after {step + 1} appends"
            a, b = _state(plain), _state(growing)
            for name in sorted(a.keys() | b.keys()):
                if not _same(a.get(name), b.get(name)):
                    return f"the layer attribute {name!r} after {step + 1} appends"
        plain.reset()
        growing.reset()
        a, b = _state(plain), _state(growing)
        for name in sorted(a.keys() | b.keys()):
            if not _same(a.get(name), b.get(name)):
                return f"the layer attribute {name!r} after reset()"
    except (TypeError, ValueError, AttributeError, RuntimeError, IndexError) as e:
        return f"{type(e).__name__}: {e}"
    return None


_PROBED: list[str | None] = []  # growing_layer_problem()'s answer, once per process


def growing_cache(config) -> DynamicCache:
    """A transformers DynamicCache whose full-attention layers are `GrowingLayer`s, or its own
    layers when `growing_layer_problem()` finds one (warned once)."""
    cache = DynamicCache(config=config)
    if not _PROBED:
        _PROBED.append(growing_layer_problem())
        if _PROBED[0]:
            log.warning(
                "models.kv_cache: GrowingLayer does not match this transformers' DynamicLayer "
                "(%s); caches keep transformers' own layers",
                _PROBED[0],
            )
    if _PROBED[0]:
        return cache
    cache.layers = [GrowingLayer() if type(x) is DynamicLayer else x for x in cache.layers]
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = GrowingLayer
    return cache


class KVStream:
    """A model's state for the active rows: KV cache, key mask [B, L], next position ids [B]."""

    def __init__(self, model, vocab_size: int, device: torch.device, capture=None, lean=None):
        self.model = model
        self.cache = growing_cache(model.config)
        self.additive = (
            isinstance(model, PreTrainedModel)
            and getattr(model.config, "_attn_implementation", None) in _ADDITIVE_MASK_ATTENTION
        )
        self.cache_kw = cache_keyword(model)
        # lean=None: models/lean.py's `enabled` decides.
        use = lean_forward.enabled if lean is None else lean
        self.lean = lean_forward.decoder(model) if use else None
        self.mask = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self.pos = torch.zeros(0, dtype=torch.long, device=device)
        self.vocab_size = vocab_size
        self.capture = capture  # a drafts.eagle3.head.FeatureCapture: also return features
        self.output = None  # the last forward's model output
        self.features = None  # the last forward's captured features (with a capture)
        self.hidden = None  # the last forward's final hidden states (when asked for)

    def forward(
        self, tokens: torch.Tensor, valid: torch.Tensor, keep: int, hidden: bool = False, **inputs
    ):
        """Append tokens [B, k] (valid [B, k], left-padded) -> last `keep` logits [B, keep, V].

        `inputs` go to the model as they are (an EAGLE-3 head's `hidden_states` [B, k, H]).
        With a capture, `self.features` holds the captured features [B, k, F] afterwards.
        With `hidden`, `self.hidden` holds the final hidden states [B, keep, H] of the kept
        positions (after the final norm: what the output head reads), from either forward;
        else None.
        """
        positions = (self.pos[:, None] + valid.long().cumsum(1) - 1).clamp_min(0)
        filled = self.mask.shape[1] > 0
        self.mask = torch.cat([self.mask, valid], dim=1)
        if self.lean is not None and not inputs and not torch.is_grad_enabled():
            record = self.capture.record if self.capture else None
            run = self.lean.with_hidden if hidden else self.lean
            out = run(tokens, positions, self.cache, self.mask, keep, record)
            logits, self.hidden = out if hidden else (out, None)
            self.output = None
        else:
            extra = {"output_hidden_states": True} if hidden else {}
            logits = self._model_forward(tokens, positions, keep, filled, inputs | extra)
            self.hidden = self.output.hidden_states[-1][:, -keep:] if hidden else None
        self.features = self.capture.features() if self.capture else None
        self.pos += valid.sum(1)
        return logits[..., : self.vocab_size]

    def _model_forward(self, tokens, positions, keep: int, filled: bool, inputs: dict):
        """transformers' forward (its whole output kept in `self.output`) -> logits."""
        attention_mask = self.mask
        k = tokens.shape[1]
        if self.additive and filled and k > 1:
            # A prefill keeps the 2-D mask (SDPA's is_causal path), and so does one token
            # (transformers then passes no mask at all unless a key is masked).
            attention_mask = additive_mask(self.mask, k, self.model.dtype)
        with self.capture or nullcontext():
            self.output = self.model(
                input_ids=tokens,
                attention_mask=attention_mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=keep,
                **{self.cache_kw: self.cache},
                **inputs,
            )
        return self.output.logits

    def _layers(self):
        for layer in self.cache.layers:
            if type(layer) not in (DynamicLayer, GrowingLayer):
                raise NotImplementedError(
                    f"cache layer {type(layer).__name__} (sliding-window or linear attention) "
                    "cannot be rolled back per row; this engine needs full-attention layers"
                )
            if layer.is_initialized:
                yield layer

    def admit(self, prefixes: Sequence[Sequence[int]], hidden=None):
        """Add rows whose caches hold `prefixes` (prefilled here, in separate forward passes).

        One prefill pads its rows to the longest, so rows of very different lengths are
        prefilled in groups of similar length (`length_groups`) and then put back in the
        order given: a batch of chat prompts of 57-503 tokens otherwise runs 2.6 times the
        tokens it holds. hidden: per row a [len(prefix), H] tensor passed as
        `hidden_states` (EAGLE-3 heads). Returns (last logits [n, V] | None, features
        [n, k, F] | None, valid [n, k]), rows in the order of `prefixes`.
        """
        groups = length_groups([len(p) for p in prefixes])
        if len(groups) == 1:
            return self._admit(prefixes, hidden)
        parts = [
            self._admit(
                [prefixes[i] for i in g], None if hidden is None else [hidden[i] for i in g]
            )
            for g in groups
        ]
        order = torch.tensor([i for g in groups for i in g])
        where = torch.empty_like(order)  # where[i]: the row prefixes[i] was admitted as
        where[order] = torch.arange(len(order))
        before = self.mask.shape[0] - len(order)
        self.select_rows(torch.cat([torch.arange(before), before + where]).to(self.mask.device))
        return _rejoined(parts, where.to(self.mask.device))

    def _admit(self, prefixes: Sequence[Sequence[int]], hidden=None):
        """`admit` for rows prefilled in one forward pass, left-padded to the longest."""
        device = self.mask.device
        new = KVStream(self.model, self.vocab_size, device, self.capture, lean=False)
        new.lean = self.lean
        new.mask = torch.zeros(len(prefixes), 0, dtype=torch.bool, device=device)
        new.pos = torch.zeros(len(prefixes), dtype=torch.long, device=device)
        logits, valid = None, torch.zeros(len(prefixes), 0, dtype=torch.bool, device=device)
        if max(len(p) for p in prefixes) > 0:
            tokens, valid = left_pad(prefixes, device)
            extra = {} if hidden is None else {"hidden_states": left_pad_rows(hidden, valid)}
            logits = new.forward(tokens, valid, keep=1, **extra)[:, -1]
        result = logits, new.features if new.mask.shape[1] else None, valid
        if self.mask.shape[0] == 0:
            self.cache, self.mask, self.pos = new.cache, new.mask, new.pos
            return result
        mine, theirs = list(self._layers()), list(new._layers())
        assert mine, "rows join an empty batch or one that has run a decoding round"
        length = max(self.mask.shape[1], new.mask.shape[1])
        for i, layer in enumerate(mine):
            for name in ("keys", "values"):
                a = getattr(layer, name)
                b = (
                    getattr(theirs[i], name)
                    if theirs
                    else a.new_zeros(len(prefixes), a.shape[1], 0, a.shape[3])
                )
                setattr(layer, name, torch.cat([pad_left(a, length, 2), pad_left(b, length, 2)]))
        self.mask = torch.cat([pad_left(self.mask, length, 1), pad_left(new.mask, length, 1)])
        self.pos = torch.cat([self.pos, new.pos])
        self._tidy()
        return result

    def _slice(self, index: slice) -> None:
        for layer in self._layers():
            layer.keys = layer.keys[:, :, index]
            layer.values = layer.values[:, :, index]
        self.mask = self.mask[:, index]

    def drop_last(self, counts: torch.Tensor) -> None:
        """Forget the last counts[b] valid tokens of each row b (all appended in the last calls)."""
        common = int(counts.min())
        if common:
            self._slice(slice(0, self.mask.shape[1] - common))
        rest = counts - common
        if bool(rest.any()):
            length = self.mask.shape[1]
            tail = torch.arange(length, device=self.mask.device)[None, :] >= length - rest[:, None]
            self.mask = self.mask & ~tail
        self.pos -= counts
        self._tidy()

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the rows at `rows` [n] (long), in that order."""
        if rows.numel() == 0:
            lean = self.lean
            self.__init__(self.model, self.vocab_size, self.mask.device, self.capture, lean=False)
            self.lean = lean
            return
        for layer in self._layers():
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)
        self.mask = self.mask.index_select(0, rows)
        self.pos = self.pos.index_select(0, rows)
        self._tidy()

    def _tidy(self) -> None:
        """Drop all-padding leading columns; right-align rows if holes + padding grew too large."""
        length = self.mask.shape[1]
        if length == 0:
            return
        first = int(self.mask.any(0).long().argmax())
        if first:
            self._slice(slice(first, length))
            length -= first
        longest = int(self.mask.sum(1).max())
        if length - longest > _COMPACT_FRACTION * length:
            # Stable sort puts each row's masked entries first and keeps valid ones in order.
            order = torch.sort(self.mask.to(torch.int8), dim=1, stable=True).indices
            keep = order[:, length - longest :]
            for layer in self._layers():
                index = keep[:, None, :, None].expand(
                    -1, layer.keys.shape[1], -1, layer.keys.shape[3]
                )
                layer.keys = layer.keys.gather(2, index)
                layer.values = layer.values.gather(2, index)
            self.mask = self.mask.gather(1, keep)


# A prefill's padding tokens may add at most this share to its real tokens (`length_groups`).
PREFILL_SLACK = 0.25


def length_groups(lengths: Sequence[int]) -> list[list[int]]:
    """The rows of one admission grouped for their prefills: indices by length, longest
    first, a row joining the group before it while the group padded to its longest holds at
    most (1 + PREFILL_SLACK) times its real tokens. One group when any row is empty (an empty
    prefix prefills nothing on its own)."""
    if not lengths or min(lengths) == 0:
        return [list(range(len(lengths)))]
    groups: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and lengths[groups[-1][0]] * (len(groups[-1]) + 1) <= (1 + PREFILL_SLACK) * (
            real + lengths[i]
        ):
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


def _rejoined(parts: list[tuple], where: torch.Tensor) -> tuple:
    """The (logits, features, valid) of groups admitted one after the other, as one
    admission of rows in their given order (`where[i]`: the joined row of row i)."""
    width = max(valid.shape[1] for _, _, valid in parts)
    logits = torch.cat([p[0] for p in parts])[where]
    valid = torch.cat([pad_left(p[2], width, 1) for p in parts])[where]
    features = None
    if parts[0][1] is not None:
        features = torch.cat([pad_left(p[1], width, 1) for p in parts])[where]
    return logits, features, valid


def pad_left(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Zero/False-pad `t` on the left of `dim` up to `length`."""
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def left_pad(
    rows: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists -> (tokens [B, k], valid [B, k] bool), right-aligned."""
    width = max(len(r) for r in rows)
    tokens = torch.tensor([[0] * (width - len(r)) + list(r) for r in rows], dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows])
    valid = torch.arange(width)[None, :] >= width - lengths[:, None]
    return tokens.to(device), valid.to(device)


def left_pad_rows(rows: Sequence[torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
    """Per-row [len_i, H] tensors -> [B, k, H] placed where `valid` [B, k] is True (zeros else)."""
    out = rows[0].new_zeros(*valid.shape, rows[0].shape[-1])
    out[valid] = torch.cat(list(rows)).to(out.dtype)
    return out
