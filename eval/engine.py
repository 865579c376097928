"""Real, lossless speculative decoding over Hugging Face causal LMs: `generate`.

Algorithm (docs/theory.md §2), per round: the draft proposes d_1..d_γ autoregressively on its
own KV cache; the target scores [pending, d_1..d_γ] in one forward pass, giving p_1..p_{γ+1};
the drafts are verified (eval/verify.py): accepted while u_i·q_i(d_i) < p_i(d_i), a
correction from the residual at the first rejection, a bonus token from p_{γ+1} when all γ
are accepted; greedy (temperature 0) accepts while d_i equals the target's argmax. Both
caches are then rolled back to the committed tokens. `draft=None` runs the same loop with
γ = 0: plain target-only decoding, the baseline.

Temperature, top-k and top-p (`losses.sampling`) make the target's p; the draft samples from
q = softmax(draft logits / T), unfiltered (docs/theory.md §1). The output is distributed
exactly as sampling from the processed target, since verification uses the q each draft was
drawn from.

Batching: every row accepts on its own (per-row KV rollback, drafts/kv_cache.py), finished
rows leave the batch and waiting prompts take their place (continuous batching). The draft
type's drafter (drafts/standalone.py, drafts/eagle3.py) keeps the draft's cache; an EAGLE-3
head's drafter asks the target to capture its features and to sample each prompt's first
token (`capture`, `target_first_token`).
"""

import math
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdistill import drafts
from specdistill.drafts.kv_cache import KVStream, eval_mode, left_pad, sync
from specdistill.eval import verify
from specdistill.losses.sampling import check_filters, probabilities

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


# ----------------------------------------------------------------------------- results


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


# ----------------------------------------------------------------------------- generate


@torch.inference_mode()
def generate(
    target,
    draft,
    input_ids,
    *,
    gamma: int | AdaptiveGamma = 4,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int | None = None,
    max_new_tokens: int = 128,
    seed: int = 0,
    batch_size: int | None = None,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | None = None,
    vocab_size: int | None = None,
) -> Generation:
    """Speculative decoding of prompts with `draft` proposing and `target` verifying.

    input_ids: [B, P] tensor (with `attention_mask` for padding) or a list of token lists.
    draft: a causal LM sharing the target's tokenizer, an EAGLE-3 head
    (drafts/eagle3_head.py), or None to decode with the target alone (the baseline).
    gamma: draft tokens per round, or an `AdaptiveGamma` policy (used for this call).
    temperature 0 is greedy (top_p / top_k then unused); top_p / top_k filter the target's
    distribution (None = off). batch_size: most rows decoded together (default: all); a
    finished row's place goes to the next waiting prompt (continuous batching; all requests
    arrive at the call's start, and TTFT / latency count from a request's admission).
    vocab_size: logit columns compared (default: the smaller head; an EAGLE-3 head counts
    with its target vocabulary). Rows stop at `max_new_tokens` or after emitting
    `eos_token_id`.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be ≥ 0, got {temperature}")
    check_filters(top_p, top_k)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    prompts = _as_lists(input_ids, attention_mask)
    if not prompts or min(len(p) for p in prompts) == 0:
        raise ValueError("every prompt needs at least one token")
    policy = gamma if isinstance(gamma, AdaptiveGamma) else None
    if draft is not None and not policy and gamma < 1:
        raise ValueError(f"gamma must be ≥ 1 with a draft, got {gamma}")
    heads = [target.get_output_embeddings().weight.shape[0]]
    if draft is not None:
        heads.append(drafts.type_of(draft).vocab_size_of(draft))
    vocab_size = vocab_size or min(heads)
    device = target.device
    generator = torch.Generator(device=device).manual_seed(seed)
    sampler = _Sampler(temperature, top_p, top_k, generator)

    with eval_mode(target, draft):
        sync(device)
        start = time.perf_counter()
        drafter = None if draft is None else drafts.drafter_for(draft, vocab_size, device)
        batch = _Batch(
            target,
            drafter,
            sampler,
            capacity=batch_size or len(prompts),
            gamma=gamma,
            eos_token_id=eos_token_id,
            vocab_size=vocab_size,
        )
        for prompt in prompts:
            batch.add(prompt, max_new_tokens)
        while batch.waiting or batch.requests:
            batch.step()
        sync(device)
        wall = time.perf_counter() - start
    ids = range(len(prompts))
    return Generation(
        [batch.outputs[r] for r in ids],
        batch.rounds,
        [batch.ttft[r] for r in ids],
        [batch.latency[r] for r in ids],
        [batch.admitted_at[r] - start for r in ids],
        batch.token_latency,
        wall,
        batch.prefill_s,
    )


def _as_lists(input_ids, attention_mask) -> list[list[int]]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if attention_mask is None:
            return input_ids.tolist()
        return [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask, strict=True)]
    return [list(map(int, ids)) for ids in input_ids]


class _Sampler:
    """Token choice at the run's temperature, argmax at temperature 0, with one generator.

    The target samples from p (temperature, top-k, top-p); the draft from q (temperature
    only): docs/theory.md §1. `rows` (the request ids of the logits' rows) is unused: every
    row of a `generate` call samples alike (`_RowSampler` is the per-request one).
    """

    def __init__(self, temperature: float, top_p, top_k, generator: torch.Generator):
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.generator = generator
        self.greedy = temperature == 0

    def p(self, logits: torch.Tensor) -> torch.Tensor:
        return probabilities(logits, self.temperature, self.top_p, self.top_k)

    def q(self, logits: torch.Tensor) -> torch.Tensor:
        return probabilities(logits, self.temperature)

    def target(self, logits: torch.Tensor, rows=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [B, V] -> (tokens [B], p [B, V] | None when greedy)."""
        return self._sample(logits, self.p)

    def draft(self, logits: torch.Tensor, rows=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [B, V] -> (tokens [B], q [B, V] | None when greedy)."""
        return self._sample(logits, self.q)

    def verify(self, logits, drafted, q, rows=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Verification of γ ≥ 1 drafts: logits [B, γ+1, V] -> (n_accepted [B], next [B])."""
        if self.greedy:
            return verify.verify_greedy(logits, drafted)
        return verify.verify_sampled(self.p(logits), torch.stack(q, dim=1), drafted, self.generator)

    def _sample(self, logits, distribution):
        if self.greedy:
            return logits.argmax(-1), None
        probs = distribution(logits)
        return verify.draw(probs, self.generator), probs


@dataclass(frozen=True)
class Sampling:
    """One request's sampling parameters (an `Engine` samples every row with its own)."""

    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None  # None: a random seed

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be ≥ 0, got {self.temperature}")
        check_filters(self.top_p, self.top_k)


class _RowSampler:
    """Per-request sampling: each row has its own temperature / top-p / top-k and its own
    torch.Generator (seeded by the request), so a seeded request draws the same random
    numbers whatever else shares the batch (with γ never shortened: `cap_gamma=False`).

    Greedy rows are verified together (argmax); each sampled row on its own, with its own
    generator. Verification stays lossless row by row (docs/theory.md §2).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.rows: dict[int, tuple[Sampling, torch.Generator | None]] = {}

    def add(self, r: int, sampling: Sampling) -> None:
        generator = None
        if sampling.temperature > 0:
            seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(7))
            generator = torch.Generator(device=self.device).manual_seed(seed)
        self.rows[r] = (sampling, generator)

    def drop(self, r: int) -> None:
        self.rows.pop(r, None)

    def target(self, logits: torch.Tensor, rows) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._sample(logits, rows, filtered=True)

    def draft(self, logits: torch.Tensor, rows) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._sample(logits, rows, filtered=False)

    def _sample(self, logits, rows, *, filtered: bool):
        tokens = logits.argmax(-1)
        probs = None
        for i, r in enumerate(rows):
            s, generator = self.rows[r]
            if s.temperature == 0:
                continue
            filters = (s.top_p, s.top_k) if filtered else ()
            row = probabilities(logits[i : i + 1], s.temperature, *filters)
            if probs is None:
                probs = torch.zeros(logits.shape, dtype=row.dtype, device=logits.device)
            probs[i] = row[0]
            tokens[i] = verify.draw(row, generator)[0]
        return tokens, probs

    def verify(self, logits, drafted, q, rows) -> tuple[torch.Tensor, torch.Tensor]:
        n_accepted, next_token = verify.verify_greedy(logits, drafted)
        for i, r in enumerate(rows):
            s, generator = self.rows[r]
            if s.temperature == 0:
                continue
            p = probabilities(logits[i : i + 1], s.temperature, s.top_p, s.top_k)
            q_i = torch.stack([step[i : i + 1] for step in q], dim=1)
            n, nxt = verify.verify_sampled(p, q_i, drafted[i : i + 1], generator)
            n_accepted[i], next_token[i] = n[0], nxt[0]
        return n_accepted, next_token


@dataclass
class Update:
    """What one `Engine.step` gave a request: new tokens (cut at EOS / max_new_tokens), their
    target log-probabilities when asked, and whether (and why) the request ended."""

    request: int
    tokens: list[int]
    logprobs: list | None = None  # per token: (logprob, [(token, logprob)] top-k)
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS) or "length"


@dataclass
class SpecStats:
    """One request's speculative statistics (vLLM's meanings: a draft = one round's
    proposal, accepted tokens exclude the bonus / correction token)."""

    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)  # accepted per position

    def as_dict(self) -> dict:
        steps = self.num_spec_steps
        return {
            "mean_acceptance_length": 1 + self.num_accepted_draft_tokens / steps if steps else 1.0,
            "draft_acceptance_rate": (
                self.num_accepted_draft_tokens / self.num_draft_tokens
                if self.num_draft_tokens
                else 0.0
            ),
            "acceptance_histogram": list(self.acceptance_histogram),
            "num_spec_steps": steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
        }


class _Batch:
    """The decoding state: the requests, the active rows and their caches.

    `requests` lists the active rows' request ids in batch order; `pending[i]` holds row i's
    committed tokens that the target's cache does not hold yet (its last token). The
    drafter keeps the draft's own cache and pending tokens, row for row. Requests come in
    with `add` at any time and join at the next `step` (continuous batching); `cancel`
    takes one out before the next round.
    """

    def __init__(
        self,
        target,
        drafter,
        sampler,
        *,
        capacity: int,
        gamma: int | AdaptiveGamma,
        eos_token_id: int | None,
        vocab_size: int,
        cap_gamma: bool = True,
        record: bool = True,
    ):
        self.device = target.device
        self.drafter = drafter
        capture = drafter.capture(target) if drafter is not None else None
        self.t_stream = KVStream(target, vocab_size, self.device, capture)
        self.sampler = sampler
        self.capacity, self.gamma = capacity, gamma
        self.eos_token_id = eos_token_id
        self.cap_gamma, self.record = cap_gamma, record
        self.prompts: dict[int, list[int]] = {}
        self.max_new: dict[int, int] = {}
        self.outputs: dict[int, list[int]] = {}
        self.ttft: dict[int, float] = {}
        self.latency: dict[int, float] = {}
        self.admitted_at: dict[int, float] = {}
        self.stats: dict[int, SpecStats] = {}
        self.logprobs_k: dict[int, int] = {}  # requests that want target log-probabilities
        self.token_latency: list[float] = []
        self.rounds: list[Round] = []
        self.updates: list[Update] = []
        self.waiting: deque[int] = deque()
        self.cancelled: set[int] = set()
        self.requests: list[int] = []
        self.pending: list[list[int]] = []
        self.prefill_s = 0.0
        self._next_id = 0
        self._round_logprobs: dict[int, list] = {}

    def add(self, prompt: list[int], max_new_tokens: int, logprobs: int | None = None) -> int:
        """Queue a request; it joins the batch at the next `step` with a free row."""
        r = self._next_id
        self._next_id += 1
        self.prompts[r], self.max_new[r] = list(prompt), max_new_tokens
        self.outputs[r] = []
        self.ttft[r] = self.latency[r] = self.admitted_at[r] = math.nan
        self.stats[r] = SpecStats()
        if logprobs is not None:
            self.logprobs_k[r] = logprobs
        self.waiting.append(r)
        return r

    def cancel(self, r: int) -> None:
        """Take request r out: at once when waiting, before the next round when active."""
        if r in self.waiting:
            self.waiting.remove(r)
        elif r in self.requests:
            self.cancelled.add(r)

    def step(self) -> list[Update]:
        """Admit waiting requests into free rows, then run one round; the round's updates."""
        self.updates = []
        if self.cancelled:
            gone = [r in self.cancelled for r in self.requests]
            self.cancelled.clear()
            if any(gone):
                self.remove(gone)
        if self.waiting and len(self.requests) < self.capacity:
            self.admit()
        if self.requests:
            g, capped = self.round_gamma()
            round_start = time.perf_counter()
            drafted, q, draft_s = self.draft(g)
            verify_start = time.perf_counter()
            n_accepted, host = self.verify(g, drafted, q)
            now = time.perf_counter()
            timing = (draft_s, now - verify_start, now - round_start)
            self.commit(g, capped, n_accepted, host, now, timing)
        return self.updates

    # ------------------------------------------------------------------ rows in and out
    def admit(self) -> None:
        """Waiting requests take the free rows; their prompts are prefilled."""
        start = time.perf_counter()
        free = min(self.capacity - len(self.requests), len(self.waiting))
        admitted = [self.waiting.popleft() for _ in range(free)]
        for r in admitted:
            self.admitted_at[r] = start
        self.requests += admitted
        if self.drafter is not None and self.drafter.target_first_token:
            self._admit_after_first_token(admitted, start)
            return
        self.t_stream.admit([self.prompts[r][:-1] for r in admitted])
        if self.drafter is not None:
            self.drafter.admit([self.prompts[r] for r in admitted])
        self.pending += [[self.prompts[r][-1]] for r in admitted]
        sync(self.device)
        self.prefill_s += time.perf_counter() - start

    def _admit_after_first_token(self, admitted: list[int], start: float) -> None:
        """EAGLE: the target prefills the whole prompt and samples the first token; the
        head needs the features of every prompt position."""
        logits, features, valid = self.t_stream.admit([self.prompts[r] for r in admitted])
        first = self.sampler.target(logits, admitted)[0].tolist()
        self.drafter.admit(
            [self.prompts[r] + [f] for r, f in zip(admitted, first, strict=True)],
            [f[v] for f, v in zip(features, valid, strict=True)],
        )
        self.pending += [[f] for f in first]
        for i, r in enumerate(admitted):
            if r in self.logprobs_k:
                self._round_logprobs[r] = _logprob_entries(
                    logits[i : i + 1], [first[i]], self.logprobs_k[r]
                )
        sync(self.device)
        now = time.perf_counter()
        done = [self.emit(r, [f], now) for r, f in zip(admitted, first, strict=True)]
        self.prefill_s += now - start
        finished = [False] * (len(self.requests) - len(admitted)) + done
        if any(finished):
            self.remove(finished)

    def remove(self, finished: list[bool]) -> None:
        """Finished rows leave the batch (and both caches)."""
        keep = [i for i, f in enumerate(finished) if not f]
        self.requests = [self.requests[i] for i in keep]
        self.pending = [self.pending[i] for i in keep]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.t_stream.select_rows(index)
        if self.drafter is not None:
            self.drafter.select_rows(keep, index)

    def emit(self, r: int, new: list[int], now: float) -> bool:
        """Append a request's new tokens (cut at EOS and at its max_new_tokens); True when
        the request is done."""
        remaining = self.max_new[r] - len(self.outputs[r])
        new = new[:remaining]
        done, reason = len(new) == remaining, "length"
        if self.eos_token_id is not None and self.eos_token_id in new:
            new = new[: new.index(self.eos_token_id) + 1]
            done, reason = True, "stop"
        if not self.outputs[r]:
            self.ttft[r] = now - self.admitted_at[r]
        self.outputs[r].extend(new)
        if done:
            self.latency[r] = now - self.admitted_at[r]
        logprobs = self._round_logprobs.pop(r, None)
        self.updates.append(
            Update(
                r,
                new,
                None if logprobs is None else logprobs[: len(new)],
                done,
                reason if done else None,
            )
        )
        return done

    # ------------------------------------------------------------------ one round
    def remaining(self) -> list[int]:
        return [self.max_new[r] - len(self.outputs[r]) for r in self.requests]

    def round_gamma(self) -> tuple[int, bool]:
        """(γ of this round, whether it was shortened: no row needs more than γ + 1 tokens).

        Without `cap_gamma` γ is never shortened, so that each row's random draws do not
        depend on the other rows (per-request seeds); the surplus is cut by `emit`.
        """
        if self.drafter is None:
            g = 0
        else:
            g = self.gamma.gamma if isinstance(self.gamma, AdaptiveGamma) else self.gamma
        if not self.cap_gamma:
            return g, False
        most = max(self.remaining())
        capped = g > most - 1
        return (most - 1 if capped else g), capped

    def draft(self, g: int) -> tuple[torch.Tensor, list, float]:
        """The drafter proposes g tokens per row: (drafts [B, g], q per slot, seconds)."""
        if g == 0:
            return torch.zeros(len(self.requests), 0, dtype=torch.long, device=self.device), [], 0.0
        start = time.perf_counter()
        rows = list(self.requests)
        drafted, q = self.drafter.propose(g, lambda logits: self.sampler.draft(logits, rows))
        sync(self.device)
        return drafted, q, time.perf_counter() - start

    def verify(self, g: int, drafted: torch.Tensor, q: list) -> tuple[torch.Tensor, list]:
        """The target scores [pending, d_1..d_g] in one pass and verifies the drafts.

        Returns (n_accepted [B], host rows [n_i, next_i, *drafts_i]) once on the host.
        """
        tokens, valid = left_pad(self.pending, self.device)
        if g > 0:
            tokens = torch.cat([tokens, drafted], dim=1)
            valid = torch.cat([valid, torch.ones_like(drafted, dtype=torch.bool)], dim=1)
        logits = self.t_stream.forward(tokens, valid, keep=g + 1)
        if g == 0:
            next_token, _ = self.sampler.target(logits[:, -1], self.requests)
            n_accepted = torch.zeros_like(next_token)
        else:
            n_accepted, next_token = self.sampler.verify(logits, drafted, q, self.requests)
        host = torch.cat([n_accepted[:, None], next_token[:, None], drafted], dim=1).tolist()
        for i, r in enumerate(self.requests):
            if r in self.logprobs_k:
                n_i, next_i, *drafts_i = host[i]
                self._round_logprobs[r] = _logprob_entries(
                    logits[i, : n_i + 1], drafts_i[:n_i] + [next_i], self.logprobs_k[r]
                )
        sync(self.device)
        return n_accepted, host

    def commit(
        self,
        g: int,
        capped: bool,
        n_accepted: torch.Tensor,
        host: list,
        now: float,
        timing: tuple[float, float, float],
    ) -> None:
        """Append each row's accepted drafts and next token, record the round, roll both
        caches back to the committed tokens, and let finished rows go."""
        starts = [len(self.outputs[r]) for r in self.requests]
        accepted = [h[0] for h in host]
        committed, finished = [], []
        round_s = timing[2]
        for i, r in enumerate(self.requests):
            n_i, next_i, drafts_i = host[i][0], host[i][1], host[i][2:]
            before = len(self.outputs[r])
            finished.append(self.emit(r, drafts_i[:n_i] + [next_i], now))
            n_new = len(self.outputs[r]) - before
            committed.append(n_new)
            if g > 0:
                stats = self.stats[r]
                stats.num_spec_steps += 1
                stats.num_draft_tokens += g
                stats.num_accepted_draft_tokens += n_i
                if len(stats.acceptance_histogram) < g:
                    stats.acceptance_histogram += [0] * (g - len(stats.acceptance_histogram))
                for j in range(n_i):
                    stats.acceptance_histogram[j] += 1
            if self.record:
                self.token_latency.extend([round_s / n_new] * n_new)
            # The target cached [pending, d_1..d_n]; the new token is pending.
            self.pending[i] = [next_i]
        if self.record:
            self.rounds.append(
                Round(g, capped, list(self.requests), starts, accepted, committed, *timing)
            )
        if isinstance(self.gamma, AdaptiveGamma) and g > 0 and not capped:
            self.gamma.update(accepted, g)

        self.t_stream.drop_last(g - n_accepted)
        if self.drafter is not None and g > 0:
            features = self.t_stream.features
            self.drafter.commit(
                g, n_accepted, host, None if features is None else features[:, -(g + 1) :]
            )
        elif self.drafter is not None:
            assert all(finished), "a γ = 0 round only happens when every row ends in it"
        if any(finished):
            self.remove(finished)


def _logprob_entries(logits: torch.Tensor, tokens: list[int], k: int) -> list:
    """The target's log-probabilities (raw logits, T = 1, unfiltered) of `tokens`, one per
    row of logits [n, V], with the top-k alternatives: [(logprob, [(token, logprob)])]."""
    logp = logits.float().log_softmax(-1)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    if k > 0:
        top = logp.topk(min(k, logp.shape[-1]), dim=-1)
        alternatives = [
            list(zip(ids, values, strict=True))
            for ids, values in zip(top.indices.tolist(), top.values.tolist(), strict=True)
        ]
    else:
        alternatives = [[] for _ in tokens]
    return list(zip(chosen, alternatives, strict=True))


# ----------------------------------------------------------------------------- Engine


class Engine:
    """A long-lived speculative decoding engine: requests join and leave between rounds.

    The serving loop (serve/) owns one per draft version, on one thread:

        engine = Engine(target, draft, gamma=4, capacity=8, eos_token_id=tok.eos_token_id)
        r = engine.add(prompt_ids, max_new_tokens=64, sampling=Sampling(0.7, top_p=0.9))
        while engine.busy:
            for update in engine.step(): ...   # new tokens of each active request

    Every row samples with its own parameters and generator (`Sampling`, `_RowSampler`);
    γ is never shortened near the end (`cap_gamma=False`), so a seeded request's output does
    not depend on what else shares the batch. `generate` is the same loop over a list known
    at its start, with one sampler for all rows.
    """

    def __init__(
        self,
        target,
        draft,
        *,
        gamma: int = 4,
        capacity: int = 8,
        eos_token_id: int | None = None,
        vocab_size: int | None = None,
    ):
        if draft is not None and gamma < 1:
            raise ValueError(f"gamma must be ≥ 1 with a draft, got {gamma}")
        heads = [target.get_output_embeddings().weight.shape[0]]
        if draft is not None:
            heads.append(drafts.type_of(draft).vocab_size_of(draft))
        self.vocab_size = vocab_size or min(heads)
        self.target, self.draft = target, draft
        target.eval()
        if draft is not None:
            draft.eval()
        device = target.device
        self.sampler = _RowSampler(device)
        drafter = None if draft is None else drafts.drafter_for(draft, self.vocab_size, device)
        self.batch = _Batch(
            target,
            drafter,
            self.sampler,
            capacity=capacity,
            gamma=gamma if draft is not None else 0,
            eos_token_id=eos_token_id,
            vocab_size=self.vocab_size,
            cap_gamma=False,
            record=False,
        )
        self._done: list[int] = []  # requests that finished in the last step

    @property
    def busy(self) -> bool:
        """Whether any request is waiting or decoding."""
        return bool(self.batch.waiting or self.batch.requests)

    @property
    def active(self) -> int:
        return len(self.batch.requests) + len(self.batch.waiting)

    def add(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        logprobs: int | None = None,
    ) -> int:
        """Queue a request (joins at the next step); its id. logprobs: top-k alternatives
        to report per generated token (0: only the token's own), None: none."""
        if not prompt:
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        r = self.batch.add(list(prompt), max_new_tokens, logprobs)
        self.sampler.add(r, sampling)
        return r

    def cancel(self, r: int) -> None:
        """Free request r's row before the next round (nothing more is reported for it)."""
        self.batch.cancel(r)
        self._forget(r)

    def stats(self, r: int) -> SpecStats:
        return self.batch.stats[r]

    @torch.inference_mode()
    def step(self) -> list[Update]:
        """Admit waiting requests, run one round; each request's new tokens. A finished
        request is forgotten after its update (read `stats` before the next step)."""
        for r in list(self._done):
            self._forget(r)
        self._done = []
        updates = self.batch.step()
        self._done = [u.request for u in updates if u.finished]
        return updates

    def _forget(self, r: int) -> None:
        b = self.batch
        for table in (
            b.prompts,
            b.max_new,
            b.outputs,
            b.ttft,
            b.latency,
            b.admitted_at,
            b.stats,
            b.logprobs_k,
        ):
            table.pop(r, None)
        self.sampler.drop(r)
