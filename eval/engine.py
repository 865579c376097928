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

Batching: every row accepts on its own (per-row KV rollback, models/kv_cache.py), finished
rows leave the batch and waiting prompts take their place (continuous batching). The draft
type's drafter (drafts/standalone/, drafts/eagle3/) keeps the draft's cache; an EAGLE-3
head's drafter asks the target to capture its features and to sample each prompt's first
token (`capture`, `target_first_token`).

γ is a number of drafts per round, "auto" or a `LengthPolicy` (eval/length_policy.py:
`length_policy` builds the policy once, here; the batch only asks it for each round's plan):
an `AdaptiveGamma`, or `AutoGamma`, each row's draft length from the drafts' predicted
acceptance and the measured cost of a round, the verification ragged (docs/theory.md §2).

Modules: eval/batch.py holds the batch (one `RowState` per request, the rounds),
eval/sampling.py the samplers, eval/length_policy.py and eval/cost_model.py the draft-length
policies; this module the two entry points, `generate` and `Engine`.
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdistill import drafts
from specdistill.eval.batch import Batch, Round, RowState, SpecStats, Update
from specdistill.eval.cli_args import DEFAULT_GAMMA
from specdistill.eval.length_policy import (
    AdaptiveGamma,
    AutoGamma,
    FixedGamma,
    LengthPolicy,
    length_policy,
)
from specdistill.eval.sampling import RowSampler, Sampler, Sampling
from specdistill.losses.sampling import check_filters
from specdistill.models.kv_cache import eval_mode, sync

GREEDY = Sampling()  # a request's default sampling: argmax

__all__ = [
    "AdaptiveGamma",
    "AutoGamma",
    "Engine",
    "Generation",
    "Round",
    "RowState",
    "Sampling",
    "SpecStats",
    "Update",
    "generate",
]

# ----------------------------------------------------------------------------- results


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
    stats: list[SpecStats] = field(default_factory=list)  # per request
    cost: dict | None = None  # a per-row policy's cost model at the end (`CostModel.summary`)
    # per request, with `logprobs`: per generated token (logprob, [(token, logprob)] top-k),
    # the target's raw log-softmax (T = 1, unfiltered) at the position that chose it
    logprobs: list[list] | None = None

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
    gamma: int | str | LengthPolicy = DEFAULT_GAMMA,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int | None = None,
    max_new_tokens: int = 128,
    seed: int = 0,
    batch_size: int | None = None,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | None = None,
    vocab_size: int | None = None,
    logprobs: int | None = None,
) -> Generation:
    """Speculative decoding of prompts with `draft` proposing and `target` verifying.

    input_ids: [B, P] tensor (with `attention_mask` for padding) or a list of token lists.
    draft: a causal LM sharing the target's tokenizer, an EAGLE-3 head
    (drafts/eagle3/head.py), or None to decode with the target alone (the baseline).
    gamma: draft tokens per round, "auto" (a fresh `AutoGamma`) or a `LengthPolicy` (used
    for this call: an `AdaptiveGamma`, an `AutoGamma` whose start-up cost measurement runs
    before the clock starts, like a server's start-up).
    temperature 0 is greedy (top_p / top_k then unused); top_p / top_k filter the target's
    distribution (None = off). batch_size: most rows decoded together (default: all); a
    finished row's place goes to the next waiting prompt (continuous batching; all requests
    arrive at the call's start, and TTFT / latency count from a request's admission).
    vocab_size: logit columns compared (default: the smaller head; an EAGLE-3 head counts
    with its target vocabulary). Rows stop at `max_new_tokens` or after emitting
    `eos_token_id`. logprobs: k ≥ 0 returns, per request and generated token, the target's
    log-probability of it and its k most probable tokens (`Generation.logprobs`).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be ≥ 0, got {temperature}")
    check_filters(top_p, top_k)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    if logprobs is not None and logprobs < 0:
        raise ValueError(f"logprobs must be ≥ 0 alternatives, got {logprobs}")
    prompts = _as_lists(input_ids, attention_mask)
    if not prompts or min(len(p) for p in prompts) == 0:
        raise ValueError("every prompt needs at least one token")
    policy = length_policy(gamma) if draft is not None else FixedGamma(0)
    vocab_size = vocab_size or drafts.compared_vocab_size(target, draft=draft)
    device = target.device
    generator = torch.Generator(device=device).manual_seed(seed)
    sampler = Sampler(temperature, top_p, top_k, generator)

    capacity = batch_size or len(prompts)
    with eval_mode(target, draft):
        policy.prepare(target, draft, vocab_size, capacity)
        sync(device)
        start = time.perf_counter()
        drafter = None if draft is None else drafts.drafter_for(draft, vocab_size, device)
        batch = Batch(
            target,
            drafter,
            sampler,
            capacity=capacity,
            policy=policy,
            eos_token_id=eos_token_id,
            vocab_size=vocab_size,
        )
        for prompt in prompts:
            batch.add(prompt, max_new_tokens, logprobs)
        taken = None if logprobs is None else [[] for _ in prompts]
        while batch.waiting or batch.requests:
            for update in batch.step():
                if taken is not None:
                    taken[update.request].extend(update.logprobs)
        sync(device)
        wall = time.perf_counter() - start
    generation = _generation(batch, len(prompts), start, wall, policy)
    generation.logprobs = taken
    return generation


def _generation(
    batch: Batch, n: int, start: float, wall: float, policy: LengthPolicy
) -> Generation:
    """`generate`'s result from its finished batch of `n` prompts (each request's output and
    timings in prompt order); `start`: the clock's `time.perf_counter()`, `wall`: the seconds
    since."""
    ids, rows = range(n), batch.rows
    return Generation(
        [rows[r].outputs for r in ids],
        batch.rounds,
        [rows[r].ttft for r in ids],
        [rows[r].latency for r in ids],
        [rows[r].admitted_at - start for r in ids],
        batch.token_latency,
        wall,
        batch.prefill_s,
        [rows[r].stats for r in ids],
        policy.cost_summary(),
    )


def _as_lists(input_ids, attention_mask) -> list[list[int]]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if attention_mask is None:
            return input_ids.tolist()
        return [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask, strict=True)]
    return [list(map(int, ids)) for ids in input_ids]


# ----------------------------------------------------------------------------- Engine


class Engine:
    """A long-lived speculative decoding engine: requests join and leave between rounds.

    The serving loop (serve/) owns one per draft version, on one thread:

        engine = Engine(target, draft, gamma=4, capacity=8, eos_token_id=tok.eos_token_id)
        r = engine.add(prompt_ids, max_new_tokens=64, sampling=Sampling(0.7, top_p=0.9))
        while engine.busy:
            for update in engine.step(): ...   # new tokens of each active request

    Every row samples with its own parameters and generator (`Sampling`, `RowSampler`);
    γ is never shortened near the end (`cap_gamma=False`), so a seeded request's output does
    not depend on what else shares the batch. `generate` is the same loop over a list known
    at its start, with one sampler for all rows. gamma="auto" (or a per-row `LengthPolicy`
    such as `AutoGamma`) sets each row's draft length per round (eval/length_policy.py; its
    costs are measured here, at `capacity` rows): still lossless, but the lengths follow
    measured timings, so a seeded request's draws may then depend on the batch and the
    machine.
    """

    def __init__(
        self,
        target,
        draft,
        *,
        gamma: int | str | LengthPolicy = DEFAULT_GAMMA,
        capacity: int = 8,
        eos_token_id: int | None = None,
        vocab_size: int | None = None,
    ):
        policy = length_policy(gamma) if draft is not None else FixedGamma(0)
        self.vocab_size = vocab_size or drafts.compared_vocab_size(target, draft=draft)
        self.target, self.draft = target, draft
        target.eval()
        if draft is not None:
            draft.eval()
        device = target.device
        self.sampler = RowSampler(device)
        drafter = None if draft is None else drafts.drafter_for(draft, self.vocab_size, device)
        with torch.inference_mode():
            policy.prepare(target, draft, self.vocab_size, capacity)
        self.batch = Batch(
            target,
            drafter,
            self.sampler,
            capacity=capacity,
            policy=policy,
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
        sampling: Sampling = GREEDY,
        logprobs: int | None = None,
    ) -> int:
        """Queue a request (joins at the next step); its id. logprobs: top-k alternatives
        to report per generated token (0: only the token's own), None: none."""
        if not prompt:
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        generator = self.sampler.generator_for(sampling)
        return self.batch.add(
            list(prompt), max_new_tokens, logprobs, sampling=sampling, generator=generator
        )

    def cancel(self, r: int) -> None:
        """Free request r's row before the next round (nothing more is reported for it)."""
        self.batch.cancel(r)
        self._forget(r)

    def stats(self, r: int) -> SpecStats:
        return self.batch.rows[r].stats

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
        self.batch.forget(r)
