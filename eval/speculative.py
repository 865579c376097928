"""Real, lossless speculative decoding over Hugging Face causal LMs, and what it measures.

    python eval/speculative.py --target embedded:code --draft embedded:code-draft \\
        --prompts ../shared/data/spec_bench_questions.jsonl --gamma 1,2,4,8 \\
        --temperature 0,1 --batch-size 1 --max-new-tokens 128 --out runs/spec

    python eval/speculative.py --target Qwen/Qwen2.5-7B-Instruct --draft runs/draft/final \\
        --prompts ../shared/data/HumanEval.jsonl.gz --gamma 2,4,6 --adaptive \\
        --temperature 0.7 --top-p 0.95 --batch-size 8 --device cuda --dtype bfloat16 --out runs/spec

The CLI writes DIR/report.json, DIR/report.md, DIR/outputs.jsonl and PNG plots (eval/report.py).

Algorithm (REFERENCE §2), per round: the draft proposes d_1..d_γ autoregressively on its own
KV cache; the target scores [pending, d_1..d_γ] in one forward pass, giving p_1..p_{γ+1};
d_i is accepted while u_i·q_i(d_i) < p_i(d_i) (u_i ~ U[0, 1)); at the first rejection one token
is drawn from the residual max(0, p_i − q_i)/Σ, and when all γ are accepted a bonus token is
drawn from p_{γ+1}. Greedy (temperature 0) accepts while d_i equals the target's argmax and
emits the target's argmax. Both caches are then rolled back to the committed tokens.
`draft=None` runs the same loop with γ = 0: plain target-only decoding, the baseline.

Temperature, top-k and top-p are applied identically to the target's and the draft's logits
(REFERENCE §1); the output is distributed exactly as sampling from the processed target.

Batching (per-sequence acceptance). Each model keeps one `DynamicCache` for the batch plus a
2-D key mask [batch, cache_len] and the next position id per row. Rows are right-aligned
(left padding). Tokens that a row rejects are *masked*, not moved: the common tail that every
row rejected is cropped off, the rest become masked holes, and position ids (passed
explicitly, = number of valid tokens before) stay exact, so holes change nothing but the
work done. When holes and padding exceed `_COMPACT_FRACTION` of the cache, one gather per
layer right-aligns every row again. This keeps each row's acceptance independent of the
others (no rollback to the batch minimum). Finished rows leave the batch and waiting prompts
take their place (continuous batching): a newcomer's prompt, all but its last token, is
prefilled in its own forward pass and its cache joins the batch's, left-padded.
"""

import argparse
import math
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdistill.eval.offline import tau_pred

# Compact (gather) a cache once padding + holes exceed this fraction of its length.
_COMPACT_FRACTION = 0.25


# ----------------------------------------------------------------------------- distributions


def probabilities(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Distribution after temperature, top-k and top-p: logits [..., V] -> probs [..., V] fp32.

    top-k keeps the k largest logits (0 = off); top-p keeps the smallest set of tokens, in
    decreasing probability, whose mass reaches `top_p` (the first token is always kept).
    """
    logits = logits.float() / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(-1)


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row from probs [B, V] -> [B], by inverting the CDF.

    Same distribution as `torch.multinomial(probs, 1)`, several times faster on CPU.
    """
    cdf = probs.cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=cdf.dtype)
    token = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_max(probs.shape[-1] - 1)
    # u · total can round up to the total; never return a token without mass.
    empty = probs.gather(-1, token) == 0
    return torch.where(empty, probs.argmax(-1, keepdim=True), token).squeeze(-1)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Residual distribution max(0, p − q)/Σ: p, q [B, V] -> [B, V]; p where the residual is empty.

    With q = 0 (the bonus position) this is p itself. An empty residual only arises from
    rounding, since a rejection requires p(d) < q(d).
    """
    residual = (p - q).clamp_min(0.0)
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(1e-30), p)


def verify_sampled(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative-sampling verification of one round for every row.

    p: [B, γ+1, V] target probabilities; q: [B, γ, V] draft probabilities; drafts: [B, γ].
    Returns (n_accepted [B], next_token [B]): the row commits drafts[:n] then next_token,
    drawn from the residual at the first rejection or from p_{γ+1} (bonus) if all accepted.
    """
    batch, gamma = drafts.shape
    p_draft = p[:, :gamma].gather(-1, drafts[..., None]).squeeze(-1)
    q_draft = q.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand(batch, gamma, generator=generator, device=p.device)
    accept = u * q_draft < p_draft  # u < p/q, i.e. accepted with probability min(1, p/q)
    n_accepted = accept.long().cumprod(1).sum(1)
    q_padded = torch.cat([q, q.new_zeros(batch, 1, q.shape[-1])], dim=1)
    rows = torch.arange(batch, device=p.device)
    residual = _residual(p[rows, n_accepted], q_padded[rows, n_accepted])
    next_token = draw(residual, generator)
    return n_accepted, next_token


def verify_greedy(
    target_logits: torch.Tensor, drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: target_logits [B, γ+1, V], drafts [B, γ] -> (n_accepted, next) [B]."""
    best = target_logits.argmax(-1)
    gamma = drafts.shape[1]
    n_accepted = (drafts == best[:, :gamma]).long().cumprod(1).sum(1)
    return n_accepted, best.gather(1, n_accepted[:, None]).squeeze(1)


# ----------------------------------------------------------------------------- model state


def _cache_keyword(model) -> str:
    """transformers ≥ 5 names the cache argument `cache`; 4.x named it `past_key_values`."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Stream:
    """A model's state for the active rows: KV cache, key mask [B, L], next position ids [B]."""

    def __init__(self, model, vocab_size: int, device: torch.device, capture=None):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.cache_kw = _cache_keyword(model)
        self.mask = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self.pos = torch.zeros(0, dtype=torch.long, device=device)
        self.vocab_size = vocab_size
        self.capture = capture  # a train.eagle3.FeatureCapture: also return target features
        self.output = None  # the last forward's model output

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor, keep: int, **inputs):
        """Append tokens [B, k] (valid [B, k], left-padded) -> last `keep` logits [B, keep, V].

        `inputs` go to the model as they are (an EAGLE-3 head's `hidden_states` [B, k, H]).
        With a capture, `self.features` holds the captured features [B, k, F] afterwards.
        """
        positions = (self.pos[:, None] + valid.long().cumsum(1) - 1).clamp_min(0)
        self.mask = torch.cat([self.mask, valid], dim=1)
        with self.capture or _no_capture():
            self.output = self.model(
                input_ids=tokens,
                attention_mask=self.mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=keep,
                **{self.cache_kw: self.cache},
                **inputs,
            )
        self.features = self.capture.features() if self.capture else None
        self.pos += valid.sum(1)
        return self.output.logits[..., : self.vocab_size]

    def _layers(self):
        for layer in self.cache.layers:
            if type(layer).__name__ != "DynamicLayer":
                raise NotImplementedError(
                    f"cache layer {type(layer).__name__} (sliding-window or linear attention) "
                    "cannot be rolled back per row; this engine needs full-attention layers"
                )
            if layer.is_initialized:
                yield layer

    def admit(self, prefixes: Sequence[Sequence[int]], hidden=None):
        """Add rows whose caches hold `prefixes` (prefilled here, in a separate forward pass).

        hidden: per row a [len(prefix), H] tensor passed as `hidden_states` (EAGLE-3 heads).
        Returns (last logits [n, V] | None, features [n, k, F] | None, valid [n, k]).
        """
        device = self.mask.device
        new = _Stream(self.model, self.vocab_size, device, self.capture)
        new.mask = torch.zeros(len(prefixes), 0, dtype=torch.bool, device=device)
        new.pos = torch.zeros(len(prefixes), dtype=torch.long, device=device)
        logits, valid = None, torch.zeros(len(prefixes), 0, dtype=torch.bool, device=device)
        if max(len(p) for p in prefixes) > 0:
            tokens, valid = _left_pad(prefixes, device)
            extra = {} if hidden is None else {"hidden_states": _left_pad_rows(hidden, valid)}
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
                setattr(layer, name, torch.cat([_pad_left(a, length, 2), _pad_left(b, length, 2)]))
        self.mask = torch.cat([_pad_left(self.mask, length, 1), _pad_left(new.mask, length, 1)])
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
        if rows.numel() == 0:
            self.__init__(self.model, self.vocab_size, self.mask.device, self.capture)
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


def _pad_left(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Zero/False-pad `t` on the left of `dim` up to `length`."""
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _left_pad(
    rows: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists -> (tokens [B, k], valid [B, k] bool), right-aligned."""
    width = max(len(r) for r in rows)
    tokens = torch.tensor([[0] * (width - len(r)) + list(r) for r in rows], dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows])
    valid = torch.arange(width)[None, :] >= width - lengths[:, None]
    return tokens.to(device), valid.to(device)


def _left_pad_rows(rows: Sequence[torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
    """Per-row [len_i, H] tensors -> [B, k, H] placed where `valid` [B, k] is True (zeros else)."""
    out = rows[0].new_zeros(*valid.shape, rows[0].shape[-1])
    out[valid] = torch.cat(list(rows)).to(out.dtype)
    return out


@contextmanager
def _no_capture():
    yield


@contextmanager
def _eval_mode(*models):
    modes = [(m, m.training) for m in models if m is not None]
    for m, _ in modes:
        m.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.train(training)


# ----------------------------------------------------------------------------- γ policy


@dataclass
class AdaptiveGamma:
    """Batch-level γ policy: lengthen after high-acceptance rounds, shorten after rejections.

    After each round, with f = mean accepted fraction over the batch's rows: f == 1 (every
    draft of every row accepted) -> γ + `up`; f < `low` -> γ − 1; bounded to [min_gamma, max_gamma].
    """

    start: int = 4
    min_gamma: int = 1
    max_gamma: int = 12
    up: int = 2
    low: float = 0.5
    gamma: int = field(init=False)

    def __post_init__(self):
        if not 1 <= self.min_gamma <= self.start <= self.max_gamma:
            raise ValueError(
                f"adaptive γ needs 1 ≤ min_gamma ≤ start ≤ max_gamma, got "
                f"{self.min_gamma}, {self.start}, {self.max_gamma}"
            )
        self.gamma = self.start

    def update(self, n_accepted: Sequence[int], gamma: int) -> None:
        fraction = sum(n_accepted) / (len(n_accepted) * gamma)
        if fraction == 1.0:
            self.gamma = min(self.gamma + self.up, self.max_gamma)
        elif fraction < self.low:
            self.gamma = max(self.gamma - 1, self.min_gamma)


# ----------------------------------------------------------------------------- engine


@dataclass
class Round:
    """One verification round. Lists are per active row, in `requests` order."""

    gamma: int  # drafts proposed this round (0: target-only step)
    capped: bool  # γ was shortened because the rows needed fewer tokens
    requests: list[int]
    starts: list[int]  # tokens each row had generated before this round
    accepted: list[int]  # drafts accepted per row (n, 0 ≤ n ≤ γ)
    committed: list[int]  # tokens appended per row (after max_new_tokens / EOS cuts)
    draft_s: float
    verify_s: float
    round_s: float


@dataclass
class Generation:
    """Output of `generate`: generated ids per request (prompt excluded) and measurements."""

    sequences: list[list[int]]
    rounds: list[Round]
    ttft_s: list[float]  # per request: from its admission into the batch to its first token
    latency_s: list[float]  # per request: from its admission to its last generated token
    queue_s: list[float]  # per request: waiting for a free row (all arrive at the call's start)
    token_latency_s: list[float]  # per generated token: its round's time / tokens the row got
    wall_s: float
    prefill_s: float  # time spent prefilling admitted prompts (inside wall_s)

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.wall_s


def _as_lists(input_ids, attention_mask) -> list[list[int]]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if attention_mask is None:
            return input_ids.tolist()
        return [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask, strict=True)]
    return [list(map(int, ids)) for ids in input_ids]


class _ModelDrafter:
    """A standalone draft LM on its own KV cache, proposing from the committed tokens.

    Its cache holds every committed token but the `pending` ones of each row (the last
    committed token, plus d_γ after a fully accepted round).
    """

    target_first_token = False  # the first token comes from a speculative round

    def __init__(self, model, vocab_size: int, device: torch.device):
        self.stream = _Stream(model, vocab_size, device)
        self.pending: list = []
        self.device = device

    def admit(self, prompts: Sequence[Sequence[int]], features=None) -> None:
        self.stream.admit([p[:-1] for p in prompts])
        self.pending += [[p[-1]] for p in prompts]

    def propose(self, gamma: int, sample) -> tuple[torch.Tensor, list]:
        """Draft γ tokens per row -> (drafts [B, γ], per-step probs [B, V] (None if greedy))."""
        tokens, valid, inputs = self._first_inputs()
        one = torch.ones(len(self.pending), 1, dtype=torch.bool, device=self.device)
        drafted, q = [], []
        for _ in range(gamma):
            token, probs = sample(self.stream.forward(tokens, valid, keep=1, **inputs)[:, -1])
            drafted.append(token)
            q.append(probs)
            tokens, valid, inputs = token[:, None], one, self._next_inputs()
        return torch.stack(drafted, dim=1), q

    def _first_inputs(self) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(tokens [B, k], valid [B, k], extra model inputs) of a round's first draft step."""
        return *_left_pad(self.pending, self.device), {}

    def _next_inputs(self) -> dict:
        """Extra model inputs of the following draft steps."""
        return {}

    def commit(self, gamma: int, n_accepted: torch.Tensor, host: list, features=None) -> None:
        """After verification: host[i] = [n_i, next_i, *drafts_i]."""
        # The draft cached d_1..d_{γ-1} and keeps d_1..d_n, so after a fully accepted round
        # d_γ is still pending next to the new token.
        for i, (n_i, next_i, *drafts_i) in enumerate(host):
            self.pending[i] = [drafts_i[-1], next_i] if n_i == gamma else [next_i]
        self.stream.drop_last((gamma - 1) - n_accepted.clamp_max(gamma - 1))

    def select_rows(self, keep: list[int], index: torch.Tensor) -> None:
        self.pending = [self.pending[i] for i in keep]
        self.stream.select_rows(index)


class _Eagle3Drafter(_ModelDrafter):
    """An EAGLE-3 head (train/eagle3.py) drafting from the target's features.

    Its cache holds one entry per committed position j < n whose target feature is known:
    (fc(feature_j), token j+1), at position j. The target gives the features of the tokens
    it verified, so after each round the accepted positions become `pending` pairs
    (fc(features) [m, H], tokens); the head's own γ−1 speculative entries (fed its pre-norm
    outputs) are always dropped. The prompt's first generated token comes from the
    target's prefill, as in EAGLE.
    """

    target_first_token = True

    def __init__(self, head, vocab_size: int, device: torch.device):
        super().__init__(head, vocab_size, device)
        self.head = head

    def admit(self, prompts: Sequence[Sequence[int]], features) -> None:
        """prompts: prompt + first token; features: per row [len(prompt), F] (positions 0..)."""
        hidden = [self._fc(f) for f in features]
        self.stream.admit([p[1:-1] for p in prompts], hidden=[h[:-1] for h in hidden])
        self.pending += [(h[-1:], [p[-1]]) for h, p in zip(hidden, prompts, strict=True)]

    def _first_inputs(self) -> tuple[torch.Tensor, torch.Tensor, dict]:
        tokens, valid = _left_pad([t for _, t in self.pending], self.device)
        hidden = _left_pad_rows([h for h, _ in self.pending], valid)
        return tokens, valid, {"hidden_states": hidden}

    def _next_inputs(self) -> dict:
        return {"hidden_states": self.stream.output.hidden_states[:, -1:]}

    def commit(self, gamma: int, n_accepted: torch.Tensor, host: list, features) -> None:
        """features [B, γ+1, F]: the target's, for [pending token, d_1..d_γ]."""
        self.stream.drop_last(torch.full_like(n_accepted, gamma - 1))
        hidden = self._fc(features)
        for i, (n_i, next_i, *drafts_i) in enumerate(host):
            self.pending[i] = (hidden[i, : n_i + 1], drafts_i[:n_i] + [next_i])

    def _fc(self, features: torch.Tensor) -> torch.Tensor:
        """Project target features (in the target's dtype, e.g. bf16) in the head's dtype."""
        return self.head.fc(features.to(self.head.fc.weight.dtype))


def _drafter(draft, vocab_size: int, device: torch.device):
    if draft is None:
        return None
    if getattr(draft, "is_eagle3", False):
        return _Eagle3Drafter(draft, vocab_size, device)
    return _ModelDrafter(draft, vocab_size, device)


@torch.inference_mode()
def generate(
    target,
    draft,
    input_ids,
    *,
    gamma: int | AdaptiveGamma = 4,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 128,
    seed: int = 0,
    batch_size: int | None = None,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | None = None,
    vocab_size: int | None = None,
) -> Generation:
    """Speculative decoding of prompts with `draft` proposing and `target` verifying.

    input_ids: [B, P] tensor (with `attention_mask` for padding) or a list of token lists.
    draft: a causal LM sharing the target's tokenizer, an EAGLE-3 head (train/eagle3.py),
    or None to decode with the target alone (the baseline).
    gamma: draft tokens per round, or an `AdaptiveGamma` policy (used for this call).
    temperature 0 is greedy (top_p / top_k then unused). batch_size: most rows decoded
    together (default: all); a finished row's place goes to the next waiting prompt
    (continuous batching; all requests arrive at the call's start, and TTFT / latency count
    from a request's admission). vocab_size: logit columns compared (default: the smaller
    head; an EAGLE-3 head counts with its target vocabulary). Rows stop at `max_new_tokens`
    or after emitting `eos_token_id`.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be ≥ 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    prompts = _as_lists(input_ids, attention_mask)
    if not prompts or min(len(p) for p in prompts) == 0:
        raise ValueError("every prompt needs at least one token")
    policy = gamma if isinstance(gamma, AdaptiveGamma) else None
    if draft is not None and not policy and gamma < 1:
        raise ValueError(f"gamma must be ≥ 1 with a draft, got {gamma}")
    eagle = getattr(draft, "is_eagle3", False)
    heads = [target.get_output_embeddings().weight.shape[0]]
    if draft is not None:
        head = draft.config.vocab_size if eagle else draft.get_output_embeddings().weight.shape[0]
        heads.append(head)
    vocab_size = vocab_size or min(heads)
    device = target.device
    greedy = temperature == 0
    generator = torch.Generator(device=device).manual_seed(seed)
    capacity = batch_size or len(prompts)

    def sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if greedy:
            return logits.argmax(-1), None
        probs = probabilities(logits, temperature, top_p, top_k)
        return draw(probs, generator), probs

    n = len(prompts)
    outputs: list[list[int]] = [[] for _ in range(n)]
    ttft = [math.nan] * n
    latency = [math.nan] * n
    admitted_at = [math.nan] * n
    token_latency: list[float] = []
    rounds: list[Round] = []
    waiting = deque(range(n))
    requests: list[int] = []  # active rows, in batch order
    t_pending: list[list[int]] = []  # per active row: committed tokens not in the target's cache
    prefill_s = 0.0

    with _eval_mode(target, draft):
        _sync(device)
        start = time.perf_counter()
        capture = None
        if eagle:
            from specdistill.drafts.eagle3_head import FeatureCapture

            capture = FeatureCapture(target, draft.aux_layers)
        t_stream = _Stream(target, vocab_size, device, capture)
        drafter = _drafter(draft, vocab_size, device)

        def remove(finished: list[bool]) -> None:
            nonlocal requests, t_pending
            keep = [i for i, f in enumerate(finished) if not f]
            requests = [requests[i] for i in keep]
            t_pending = [t_pending[i] for i in keep]
            index = torch.tensor(keep, dtype=torch.long, device=device)
            t_stream.select_rows(index)
            if drafter:
                drafter.select_rows(keep, index)

        def emit(r: int, new: list[int], now: float, remaining: int) -> bool:
            """Append a request's new tokens (cut at EOS); True when the request is done."""
            done = len(new) == remaining
            if eos_token_id is not None and eos_token_id in new:
                new[:] = new[: new.index(eos_token_id) + 1]
                done = True
            if not outputs[r]:
                ttft[r] = now - admitted_at[r]
            outputs[r].extend(new)
            if done:
                latency[r] = now - admitted_at[r]
            return done

        while waiting or requests:
            if waiting and len(requests) < capacity:
                admit_start = time.perf_counter()
                admitted = [
                    waiting.popleft() for _ in range(min(capacity - len(requests), len(waiting)))
                ]
                for r in admitted:
                    admitted_at[r] = admit_start
                requests += admitted
                if drafter and drafter.target_first_token:
                    # EAGLE: the target prefills the whole prompt and samples the first token;
                    # the head needs the features of every prompt position.
                    logits, features, valid = t_stream.admit([prompts[r] for r in admitted])
                    first = sample(logits)[0].tolist()
                    drafter.admit(
                        [prompts[r] + [f] for r, f in zip(admitted, first, strict=True)],
                        [f[v] for f, v in zip(features, valid, strict=True)],
                    )
                    t_pending += [[f] for f in first]
                    _sync(device)
                    now = time.perf_counter()
                    done = [
                        emit(r, [f], now, max_new_tokens)
                        for r, f in zip(admitted, first, strict=True)
                    ]
                    prefill_s += now - admit_start
                    finished = [False] * (len(requests) - len(admitted)) + done
                    if any(finished):
                        remove(finished)
                    if not requests:
                        continue
                else:
                    prefixes = [prompts[r][:-1] for r in admitted]
                    t_stream.admit(prefixes)
                    if drafter:
                        drafter.admit([prompts[r] for r in admitted])
                    t_pending += [[prompts[r][-1]] for r in admitted]
                    _sync(device)
                    prefill_s += time.perf_counter() - admit_start

            batch = len(requests)
            remaining = [max_new_tokens - len(outputs[r]) for r in requests]
            g = 0 if drafter is None else (policy.gamma if policy else gamma)
            capped = g > max(remaining) - 1
            if capped:
                g = max(remaining) - 1
            round_start = time.perf_counter()

            draft_s = 0.0
            t_tokens, t_valid = _left_pad(t_pending, device)
            if g > 0:
                drafts, q = drafter.propose(g, sample)
                _sync(device)
                draft_s = time.perf_counter() - round_start
                t_tokens = torch.cat([t_tokens, drafts], dim=1)
                t_valid = torch.cat([t_valid, torch.ones_like(drafts, dtype=torch.bool)], dim=1)

            verify_start = time.perf_counter()
            logits = t_stream.forward(t_tokens, t_valid, keep=g + 1)
            if g == 0:
                next_token, _ = sample(logits[:, -1])
                n_accepted = torch.zeros_like(next_token)
                drafts = next_token.new_zeros(batch, 0)
            elif greedy:
                n_accepted, next_token = verify_greedy(logits, drafts)
            else:
                p = probabilities(logits, temperature, top_p, top_k)
                n_accepted, next_token = verify_sampled(p, torch.stack(q, dim=1), drafts, generator)
            host = torch.cat([n_accepted[:, None], next_token[:, None], drafts], dim=1).tolist()
            _sync(device)
            now = time.perf_counter()
            verify_s = now - verify_start
            round_s = now - round_start

            starts = [len(outputs[r]) for r in requests]
            accepted = [h[0] for h in host]
            committed, finished = [], []
            for i, r in enumerate(requests):
                n_i, next_i, drafts_i = host[i][0], host[i][1], host[i][2:]
                new = (drafts_i[:n_i] + [next_i])[: remaining[i]]
                finished.append(emit(r, new, now, remaining[i]))
                committed.append(len(new))
                token_latency.extend([round_s / len(new)] * len(new))
                # The target cached [pending, d_1..d_n]; the new token is pending.
                t_pending[i] = [next_i]
            rounds.append(
                Round(
                    g,
                    capped,
                    list(requests),
                    starts,
                    accepted,
                    committed,
                    draft_s,
                    verify_s,
                    round_s,
                )
            )
            if policy and g > 0 and not capped:
                policy.update(accepted, g)

            t_stream.drop_last(g - n_accepted)
            if drafter and g > 0:
                features = t_stream.features[:, -(g + 1) :] if capture else None
                drafter.commit(g, n_accepted, host, features)
            elif drafter:
                assert all(finished), "a γ = 0 round only happens when every row ends in it"
            if any(finished):
                remove(finished)
        _sync(device)
        wall = time.perf_counter() - start
    queue = [t - start for t in admitted_at]
    return Generation(outputs, rounds, ttft, latency, queue, token_latency, wall, prefill_s)


# ----------------------------------------------------------------------------- metrics


def acceptance_stats(rounds: Sequence[Round]) -> dict:
    """Acceptance metrics over speculative rounds (γ ≥ 1, not length-capped).

    tau: mean tokens per row-round (accepted drafts + 1), counted per round (REFERENCE §1);
    slot_acceptance[i-1]: P(slot i accepted | slots < i accepted), over rounds with γ ≥ i;
    rejection_histogram[i-1]: row-rounds whose first rejection was slot i; `no_rejection`
    counts row-rounds that accepted all γ; acceptance_rate: accepted / (accepted + rejections).
    `tau_from_slots` = 1 + Σ_j Π_{i≤j} slot_acceptance_i equals tau for a fixed γ.
    """
    pairs = [(r.gamma, n) for r in rounds if r.gamma > 0 and not r.capped for n in r.accepted]
    if not pairs:
        raise ValueError("no speculative rounds to summarise")
    max_gamma = max(g for g, _ in pairs)
    reached = [0] * max_gamma
    passed = [0] * max_gamma
    rejections = [0] * max_gamma
    for g, n in pairs:
        for i in range(min(n + 1, g)):
            reached[i] += 1
            passed[i] += i < n
        if n < g:
            rejections[n] += 1
    slot = [passed[i] / reached[i] if reached[i] else math.nan for i in range(max_gamma)]
    tau_from_slots, run = 1.0, 1.0
    for rate in slot:
        if math.isnan(rate):
            break
        run *= rate
        tau_from_slots += run
    n_accepted = sum(n for _, n in pairs)
    n_rejected = sum(rejections)
    return {
        "tau": sum(n + 1 for _, n in pairs) / len(pairs),
        "tau_from_slots": tau_from_slots,
        "slot_acceptance": slot,
        "rejection_histogram": rejections,
        "no_rejection": len(pairs) - n_rejected,
        "acceptance_rate": n_accepted / (n_accepted + n_rejected)
        if n_accepted + n_rejected
        else 1.0,
        "row_rounds": len(pairs),
        "mean_gamma": sum(g for g, _ in pairs) / len(pairs),
    }


def alpha_for_tau(tau: float, gamma: int) -> float:
    """The i.i.d. α whose expected τ(α, γ) equals `tau` (bisection; τ is increasing in α)."""
    tau = min(max(tau, 1.0), gamma + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tau_pred(mid, gamma) < tau else (lo, mid)
    return (lo + hi) / 2


def speedup_model(alpha: float, gamma: int, c: float) -> float:
    """Leviathan et al. Thm 3.8: (1 − α^(γ+1)) / ((1 − α)(γc + 1)) (REFERENCE §1)."""
    return tau_pred(alpha, gamma) / (gamma * c + 1.0)


def best_gamma_model(alpha: float, c: float, max_gamma: int = 16) -> int:
    return max(range(1, max_gamma + 1), key=lambda g: speedup_model(alpha, g, c))


@torch.inference_mode()
def positional_alpha(
    target,
    draft,
    prompt: Sequence[int],
    output: Sequence[int],
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    vocab_size: int | None = None,
    depth: int = 1,
) -> list[float] | list[list[float]]:
    """Offline α along the generated text, teacher-forced on prompt + output.

    Standalone draft: len(output) + 1 floats; entry j is Σ_x min(p(x), q(x)) for the token
    after prompt + output[:j] (argmax agreement at temperature 0), with the same temperature /
    top-p / top-k the verifier uses.
    EAGLE-3 head: `depth` lists; entry [k][s] is the α of the k-th draft (0-based) of a round
    that starts at generated position s (it predicts output[s + k]), the head unrolled on the
    teacher-forced text as in training (0 where the text runs out).
    """
    ids = torch.tensor([list(prompt) + list(output)], device=target.device)
    with _eval_mode(target, draft):
        if getattr(draft, "is_eagle3", False):
            return _eagle3_positional_alpha(
                target, draft, ids, len(prompt), len(output), depth, (temperature, top_p, top_k)
            )
        heads = [m.get_output_embeddings().weight.shape[0] for m in (target, draft)]
        vocab_size = vocab_size or min(heads)
        keep = len(output) + 1
        t_logits = target(input_ids=ids, logits_to_keep=keep).logits[0, :, :vocab_size]
        d_logits = draft(input_ids=ids.to(draft.device), logits_to_keep=keep).logits[
            0, :, :vocab_size
        ]
    return _alpha(t_logits, d_logits.to(t_logits.device), temperature, top_p, top_k).tolist()


def _alpha(t_logits, d_logits, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """α per row as the verifier sees it: [N, V], [N, V] -> [N]."""
    if temperature == 0:
        return (t_logits.argmax(-1) == d_logits.argmax(-1)).float()
    p = probabilities(t_logits, temperature, top_p, top_k)
    q = probabilities(d_logits, temperature, top_p, top_k)
    return torch.minimum(p, q).sum(-1)


def _eagle3_positional_alpha(target, head, ids, n_prompt, n_out, depth, sampling):
    from specdistill.drafts.eagle3_head import FeatureCapture

    vocab = head.config.vocab_size
    with FeatureCapture(target, head.aux_layers) as capture:
        t_logits = target(input_ids=ids).logits[0, :, :vocab]
    steps = head.unroll(capture.features().to(head.fc.weight.dtype), ids, None, depth)
    alphas = []
    for k, logits in enumerate(steps):
        full = head._logits_to_full(logits[0])
        row = []
        for s in range(n_out + 1):
            t = n_prompt + s - 2  # the chain whose k-th draft predicts output[s + k]
            if t < 0 or t + k + 1 >= ids.shape[1]:
                row.append(0.0)
                continue
            row.append(float(_alpha(t_logits[t + k + 1][None], full[t][None], *sampling)[0]))
        alphas.append(row)
    return alphas


def pathwise_tau(rounds: Sequence[Round], alphas: Sequence) -> float:
    """τ predicted from per-position offline α along the generated text, at the rounds' starts.

    A round that starts at generated position s with γ drafts is predicted to commit
    1 + Σ_{j≤γ} Π_{i≤j} α_i tokens, α_i = alphas[request][s+i−1] (standalone) or
    alphas[request][i−1][s] (EAGLE-3, per depth), from `positional_alpha`.
    At temperature 0 this equals the measured τ exactly (α is argmax agreement on the path).
    """
    total, count = 0.0, 0
    for r in rounds:
        if r.gamma == 0 or r.capped:
            continue
        for request, s in zip(r.requests, r.starts, strict=True):
            a = alphas[request]
            per_depth = bool(a) and isinstance(a[0], list)
            run, tau = 1.0, 1.0
            for i in range(r.gamma):
                if per_depth:
                    run *= a[i][s] if i < len(a) and s < len(a[i]) else 0.0
                else:
                    run *= a[s + i] if s + i < len(a) else 0.0
                tau += run
            total += tau
            count += 1
    return total / count


def percentiles(values: Sequence[float]) -> dict:
    data = torch.tensor([v for v in values if not math.isnan(v)], dtype=torch.float64)
    if data.numel() == 0:
        return {"p50": math.nan, "p95": math.nan, "p99": math.nan, "mean": math.nan}
    qs = torch.quantile(data, torch.tensor([0.5, 0.95, 0.99], dtype=torch.float64)).tolist()
    return {"p50": qs[0], "p95": qs[1], "p99": qs[2], "mean": float(data.mean())}


def cost_ratios(spec: Sequence[Round], baseline: Sequence[Round]) -> tuple[float, float]:
    """(c, v) from speculative rounds and target-only rounds (prefill is never in a round).

    c = draft time per drafted token ÷ target time per decoding step (REFERENCE §1);
    v = verification time per round ÷ target time per decoding step. The ideal speedup
    τ/(γc + 1) assumes v = 1; v > 1 is the extra cost of scoring γ + 1 tokens in one pass
    (on CPUs, matrix-matrix instead of matrix-vector kernels).
    """
    spec_rounds = [r for r in spec if r.gamma > 0]
    if not spec_rounds or not baseline:
        return math.nan, math.nan
    target_per_step = sum(r.verify_s for r in baseline) / len(baseline)
    draft_per_token = sum(r.draft_s for r in spec_rounds) / sum(r.gamma for r in spec_rounds)
    verify_per_round = sum(r.verify_s for r in spec_rounds) / len(spec_rounds)
    return draft_per_token / target_per_step, verify_per_round / target_per_step


# ----------------------------------------------------------------------------- periodic eval


def quick_eval(
    target,
    draft,
    prompts_ids: Sequence[Sequence[int]],
    gammas: Sequence[int] = (1, 2, 4, 8),
    temperature: float = 0.0,
    max_new_tokens: int = 64,
    *,
    top_p: float = 1.0,
    batch_size: int = 1,
    seed: int = 0,
) -> dict:
    """Short real speculative-decoding run for periodic evaluation during training.

    Returns {"tau": {γ: τ}, "speedup": {γ: tokens/s ÷ target-only tokens/s}, "best_gamma",
    "best_tau", "best_speedup", "acceptance_rate": {γ: pooled}, "tokens_per_s": {γ: ...},
    "target_tokens_per_s"}. Models are switched to eval mode for the run and restored; pass
    the bare models (not DDP / accelerate wrappers).
    """
    common = dict(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
    # Warm-up, so that the first timed run does not pay for lazy initialisation.
    generate(target, draft, prompts_ids[:1], gamma=gammas[0], **{**common, "max_new_tokens": 2})
    baseline = generate(target, None, prompts_ids, batch_size=batch_size, **common)
    result: dict = {"tau": {}, "speedup": {}, "acceptance_rate": {}, "tokens_per_s": {}}
    for g in gammas:
        spec = generate(target, draft, prompts_ids, gamma=g, batch_size=batch_size, **common)
        stats = acceptance_stats(spec.rounds)
        result["tau"][g] = stats["tau"]
        result["acceptance_rate"][g] = stats["acceptance_rate"]
        result["tokens_per_s"][g] = spec.tokens_per_s
        result["speedup"][g] = spec.tokens_per_s / baseline.tokens_per_s
    best = max(gammas, key=lambda g: result["speedup"][g])
    result.update(
        best_gamma=best,
        best_tau=result["tau"][best],
        best_speedup=result["speedup"][best],
        target_tokens_per_s=baseline.tokens_per_s,
    )
    return result


# ----------------------------------------------------------------------------- CLI


def _ints(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1, at least one (γ values)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"needs at least one integer >= 1, comma-separated; got {text!r}"
        )
    return values


def _floats(text: str) -> list[float]:
    """argparse type: comma-separated finite numbers >= 0, at least one (temperatures)."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v >= 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"needs at least one number >= 0, comma-separated; got {text!r}"
        )
    return values


def _at_least(low: int):
    """argparse type: an integer >= `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"needs an integer >= {low}; got {text!r}")
        return value

    return parse


def _top_p(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"needs a number in (0, 1]; got {text!r}")
    return value


def _check_out_dir(out: str) -> str | None:
    """Why `out` cannot take the report, or None if it can.

    It must be a directory or creatable (it is created); writability is tested with a probe
    file that is removed again.
    """
    path = Path(out)
    if path.exists() and not path.is_dir():
        return f"{out} exists and is not a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"{out} is not a writable directory ({e.strerror or e})"
    return None


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    positive = _at_least(1)
    parser.add_argument("--target", required=True, help="HF id, local dir or embedded:<name>")
    parser.add_argument("--draft", required=True, help="HF id, local dir or embedded:<name>")
    parser.add_argument("--prompts", required=True, help=".txt (one per line), .jsonl/.json(.gz)")
    parser.add_argument(
        "--out", required=True, help="output directory (created; checked writable before decoding)"
    )
    parser.add_argument(
        "--gamma", type=_ints, default=[1, 2, 4, 8], help="comma-separated γ values; each >= 1"
    )
    parser.add_argument(
        "--adaptive", action="store_true", help="add an adaptive-γ run in [min γ, max γ]"
    )
    parser.add_argument(
        "--temperature", type=_floats, default=[0.0], help="comma-separated, >= 0; 0 = greedy"
    )
    parser.add_argument("--top-p", type=_top_p, default=1.0, help="in (0, 1]; 1 = off")
    parser.add_argument("--top-k", type=_at_least(0), default=0, help=">= 0; 0 = off")
    parser.add_argument(
        "--batch-size", type=positive, default=1, help="requests decoded together; >= 1"
    )
    parser.add_argument("--max-new-tokens", type=positive, default=128, help=">= 1")
    parser.add_argument(
        "--max-prompt-tokens", type=positive, default=1024, help="keep the last N prompt tokens"
    )
    parser.add_argument(
        "--num-prompts", type=positive, default=None, help="use the first N prompts"
    )
    parser.add_argument("--stop-at-eos", action="store_true", help="end requests at EOS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from specdistill.eval import report
    from specdistill.eval.prompts import encode_prompts, load_prompts
    from specdistill.train.models import check_tokenizers, load_draft, load_model, load_tokenizer

    # A bad prompt file or --out fails now, not after the models have loaded and decoded.
    prompts = load_prompts(args.prompts, limit=args.num_prompts)
    if problem := _check_out_dir(args.out):
        parser.error(f"--out: {problem}")
    tokenizer = load_tokenizer(args.target)
    draft = load_draft(args.draft, dtype=args.dtype)
    if getattr(draft, "is_eagle3", False):
        if draft.config.vocab_size > len(tokenizer):
            raise ValueError(
                f"the EAGLE-3 head {args.draft} covers {draft.config.vocab_size} token ids; "
                f"the target's tokenizer has {len(tokenizer)}: it was trained for another target"
            )
    else:
        check_tokenizers(tokenizer, load_tokenizer(args.draft), args.target, args.draft)
    target = load_model(args.target, dtype=args.dtype)
    target.to(args.device)
    draft.to(args.device)
    prompt_ids = encode_prompts(prompts, tokenizer, max_tokens=args.max_prompt_tokens)
    settings = report.Settings(
        gammas=args.gamma,
        adaptive=args.adaptive,
        temperatures=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        eos_token_id=tokenizer.eos_token_id if args.stop_at_eos else None,
        seed=args.seed,
    )
    result, runs = report.evaluate(target, draft, prompt_ids, settings)
    result["meta"] = {
        "target": args.target,
        "draft": args.draft,
        "prompts": args.prompts,
        "n_prompts": len(prompts),
        "device": args.device,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
    }
    report.write(result, runs, prompts, tokenizer, args.out)
    print(report.summary_table(result))
    return result


if __name__ == "__main__":
    import sys

    from specdistill.errors import run_guarded

    sys.exit(run_guarded(main, sys.argv[1:]))
