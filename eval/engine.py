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

Batching: every row accepts on its own (per-row KV rollback, drafts/cache.py), finished
rows leave the batch and waiting prompts take their place (continuous batching). The draft
type's drafter (drafts/standalone.py, drafts/eagle3.py) keeps the draft's cache; an EAGLE-3
head's drafter asks the target to capture its features and to sample each prompt's first
token (`capture`, `target_first_token`).
"""

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdistill import drafts
from specdistill.drafts.cache import KVStream, eval_mode, left_pad, sync
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
            prompts,
            sampler,
            capacity=batch_size or len(prompts),
            gamma=gamma,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            vocab_size=vocab_size,
        )
        while batch.waiting or batch.requests:
            if batch.waiting and len(batch.requests) < batch.capacity:
                batch.admit()
                if not batch.requests:  # every newcomer ended with its first token
                    continue
            g, capped = batch.round_gamma()
            round_start = time.perf_counter()
            drafted, q, draft_s = batch.draft(g)
            verify_start = time.perf_counter()
            n_accepted, host = batch.verify(g, drafted, q)
            now = time.perf_counter()
            timing = (draft_s, now - verify_start, now - round_start)
            batch.commit(g, capped, n_accepted, host, now, timing)
        sync(device)
        wall = time.perf_counter() - start
    queue = [t - start for t in batch.admitted_at]
    return Generation(
        batch.outputs,
        batch.rounds,
        batch.ttft,
        batch.latency,
        queue,
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
    only): docs/theory.md §1.
    """

    def __init__(self, temperature: float, top_p, top_k, generator: torch.Generator):
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.generator = generator
        self.greedy = temperature == 0

    def p(self, logits: torch.Tensor) -> torch.Tensor:
        return probabilities(logits, self.temperature, self.top_p, self.top_k)

    def q(self, logits: torch.Tensor) -> torch.Tensor:
        return probabilities(logits, self.temperature)

    def target(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [B, V] -> (tokens [B], p [B, V] | None when greedy)."""
        return self._sample(logits, self.p)

    def draft(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [B, V] -> (tokens [B], q [B, V] | None when greedy)."""
        return self._sample(logits, self.q)

    def _sample(self, logits, distribution):
        if self.greedy:
            return logits.argmax(-1), None
        probs = distribution(logits)
        return verify.draw(probs, self.generator), probs


class _Batch:
    """The state of one `generate` call: the requests, the active rows and their caches.

    `requests` lists the active rows' request ids in batch order; `pending[i]` holds row i's
    committed tokens that the target's cache does not hold yet (its last token). The
    drafter keeps the draft's own cache and pending tokens, row for row.
    """

    def __init__(
        self,
        target,
        drafter,
        prompts: list[list[int]],
        sampler: _Sampler,
        *,
        capacity: int,
        gamma: int | AdaptiveGamma,
        max_new_tokens: int,
        eos_token_id: int | None,
        vocab_size: int,
    ):
        self.device = target.device
        self.drafter = drafter
        capture = drafter.capture(target) if drafter is not None else None
        self.t_stream = KVStream(target, vocab_size, self.device, capture)
        self.prompts, self.sampler = prompts, sampler
        self.capacity, self.gamma = capacity, gamma
        self.max_new_tokens, self.eos_token_id = max_new_tokens, eos_token_id
        n = len(prompts)
        self.outputs: list[list[int]] = [[] for _ in range(n)]
        self.ttft = [math.nan] * n
        self.latency = [math.nan] * n
        self.admitted_at = [math.nan] * n
        self.token_latency: list[float] = []
        self.rounds: list[Round] = []
        self.waiting = deque(range(n))
        self.requests: list[int] = []
        self.pending: list[list[int]] = []
        self.prefill_s = 0.0

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
        first = self.sampler.target(logits)[0].tolist()
        self.drafter.admit(
            [self.prompts[r] + [f] for r, f in zip(admitted, first, strict=True)],
            [f[v] for f, v in zip(features, valid, strict=True)],
        )
        self.pending += [[f] for f in first]
        sync(self.device)
        now = time.perf_counter()
        done = [
            self.emit(r, [f], now, self.max_new_tokens)
            for r, f in zip(admitted, first, strict=True)
        ]
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

    def emit(self, r: int, new: list[int], now: float, remaining: int) -> bool:
        """Append a request's new tokens (cut at EOS); True when the request is done."""
        done = len(new) == remaining
        if self.eos_token_id is not None and self.eos_token_id in new:
            new[:] = new[: new.index(self.eos_token_id) + 1]
            done = True
        if not self.outputs[r]:
            self.ttft[r] = now - self.admitted_at[r]
        self.outputs[r].extend(new)
        if done:
            self.latency[r] = now - self.admitted_at[r]
        return done

    # ------------------------------------------------------------------ one round
    def remaining(self) -> list[int]:
        return [self.max_new_tokens - len(self.outputs[r]) for r in self.requests]

    def round_gamma(self) -> tuple[int, bool]:
        """(γ of this round, whether it was shortened: no row needs more than γ + 1 tokens)."""
        if self.drafter is None:
            g = 0
        else:
            g = self.gamma.gamma if isinstance(self.gamma, AdaptiveGamma) else self.gamma
        most = max(self.remaining())
        capped = g > most - 1
        return (most - 1 if capped else g), capped

    def draft(self, g: int) -> tuple[torch.Tensor, list, float]:
        """The drafter proposes g tokens per row: (drafts [B, g], q per slot, seconds)."""
        if g == 0:
            return torch.zeros(len(self.requests), 0, dtype=torch.long, device=self.device), [], 0.0
        start = time.perf_counter()
        drafted, q = self.drafter.propose(g, self.sampler.draft)
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
            next_token, _ = self.sampler.target(logits[:, -1])
            n_accepted = torch.zeros_like(next_token)
        elif self.sampler.greedy:
            n_accepted, next_token = verify.verify_greedy(logits, drafted)
        else:
            p = self.sampler.p(logits)
            n_accepted, next_token = verify.verify_sampled(
                p, torch.stack(q, dim=1), drafted, self.sampler.generator
            )
        host = torch.cat([n_accepted[:, None], next_token[:, None], drafted], dim=1).tolist()
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
        remaining = self.remaining()
        starts = [len(self.outputs[r]) for r in self.requests]
        accepted = [h[0] for h in host]
        committed, finished = [], []
        round_s = timing[2]
        for i, r in enumerate(self.requests):
            n_i, next_i, drafts_i = host[i][0], host[i][1], host[i][2:]
            new = (drafts_i[:n_i] + [next_i])[: remaining[i]]
            finished.append(self.emit(r, new, now, remaining[i]))
            committed.append(len(new))
            self.token_latency.extend([round_s / len(new)] * len(new))
            # The target cached [pending, d_1..d_n]; the new token is pending.
            self.pending[i] = [next_i]
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
