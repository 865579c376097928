"""The speculative decoding engine's batch: one `RowState` per request, the active rows and
their KV caches, and one verification round at a time (eval/engine.py drives it).

Per round: the draft proposes d_1..d_γ autoregressively on its own KV cache; the target
scores [pending, d_1..d_γ] in one forward pass; the drafts are verified (eval/verify.py,
through the sampler of eval/sampling.py); each row commits its accepted drafts and the
next token, and both caches are rolled back to the committed tokens, row by row
(models/kv_cache.py). Finished rows leave the batch and waiting requests take their place
(continuous batching).

The draft length is a `LengthPolicy` (eval/length_policy.py), asked for each round's plan:
one γ for every row (`FixedGamma`, `AdaptiveGamma`), or each row's own number of drafts
k_i ≤ γ (`AutoGamma`: the round's draft steps γ; the target scores every row's γ slots, and
row i accepts at most k_i of them: ragged verification). A round may also be a plain target
step (γ = 0), after which the drafter takes the new token as pending.
"""

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from specdistill.drafts.types import Proposal
from specdistill.eval.length_policy import LengthPolicy
from specdistill.eval.round_stats import Round, SpecStats, Update
from specdistill.eval.sampling import Sampling, logprob_entries
from specdistill.models.kv_cache import KVStream, left_pad, sync

__all__ = ["Batch", "Round", "RowState", "SpecStats", "Update"]


@dataclass
class RowState:
    """One request, from `add` until it is forgotten: everything the batch keeps about it.

    `pending` holds the committed tokens that the target's cache does not hold yet (its last
    token) while the request has a row; `round_logprobs` the target log-probabilities of
    the round being committed, for a request that asked for them (`logprobs_k` alternatives).
    """

    request: int
    prompt: list[int]
    max_new: int
    logprobs_k: int | None = None  # None: no log-probabilities wanted
    sampling: Sampling = field(default_factory=Sampling)
    generator: torch.Generator | None = None  # a sampled request's own (Engine)
    outputs: list[int] = field(default_factory=list)
    admitted_at: float = math.nan
    ttft: float = math.nan
    latency: float = math.nan
    stats: SpecStats = field(default_factory=SpecStats)
    pending: list[int] = field(default_factory=list)
    round_logprobs: list | None = None
    acceptance_estimate: float = 1.0  # per-draft acceptance (EMA; a `LengthPolicy`'s input)

    @property
    def remaining(self) -> int:
        """Tokens this request may still generate."""
        return self.max_new - len(self.outputs)

    def take(self, new: list[int], eos_token_id: int | None, now: float) -> Update:
        """Append this round's new tokens, cut at EOS and at max_new_tokens, and say so."""
        remaining = self.remaining
        new = new[:remaining]
        done, reason = len(new) == remaining, "length"
        if eos_token_id is not None and eos_token_id in new:
            new = new[: new.index(eos_token_id) + 1]
            done, reason = True, "stop"
        if not self.outputs:
            self.ttft = now - self.admitted_at
        self.outputs.extend(new)
        if done:
            self.latency = now - self.admitted_at
        logprobs, self.round_logprobs = self.round_logprobs, None
        kept = None if logprobs is None else logprobs[: len(new)]
        return Update(self.request, new, kept, done, reason if done else None)


# ----------------------------------------------------------------------------- the batch


class Batch:
    """The decoding state: the requests' `RowState`s, the active rows and their caches.

    `rows` maps each known request id to its state; `requests` lists the active rows'
    request ids in batch order, `waiting` the queued ones. The drafter keeps the draft's own
    cache and pending tokens, row for row. Requests come in with `add` at any time and join
    at the next `step` (continuous batching); `cancel` takes one out before the next round;
    `forget` drops a request's state.
    """

    def __init__(
        self,
        target,
        drafter,
        sampler,
        *,
        capacity: int,
        policy: LengthPolicy,
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
        self.capacity = capacity
        self.policy = policy  # prepared by the caller; γ = 0 without a drafter
        self.eos_token_id = eos_token_id
        self.cap_gamma, self.record = cap_gamma, record
        self.rows: dict[int, RowState] = {}
        self.token_latency: list[float] = []
        self.rounds: list[Round] = []
        self.updates: list[Update] = []
        self.waiting: deque[int] = deque()
        self.cancelled: set[int] = set()
        self.requests: list[int] = []
        self.prefill_s = 0.0
        self._next_id = 0

    def add(
        self,
        prompt: list[int],
        max_new_tokens: int,
        logprobs: int | None = None,
        *,
        sampling: Sampling | None = None,
        generator: torch.Generator | None = None,
    ) -> int:
        """Queue a request; it joins the batch at the next `step` with a free row."""
        r = self._next_id
        self._next_id += 1
        self.rows[r] = RowState(
            r, list(prompt), max_new_tokens, logprobs, sampling or Sampling(), generator
        )
        self.waiting.append(r)
        return r

    def cancel(self, r: int) -> None:
        """Take request r out: at once when waiting, before the next round when active."""
        if r in self.waiting:
            self.waiting.remove(r)
        elif r in self.requests:
            self.cancelled.add(r)

    def forget(self, r: int) -> None:
        """Drop request r's state (after its last update, or once cancelled)."""
        self.rows.pop(r, None)

    def active_rows(self) -> list[RowState]:
        """The active rows' states, in batch order."""
        return [self.rows[r] for r in self.requests]

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
            round_start = time.perf_counter()
            proposal, lengths, capped, draft_s = self.draft()
            g = proposal.tokens.shape[1]
            verify_start = time.perf_counter()
            n_accepted, host = self.verify(proposal, lengths)
            now = time.perf_counter()
            timing = (draft_s, now - verify_start, now - round_start)
            self.policy.observe(len(self.requests), g, timing[1])
            self.commit(proposal, lengths, capped, n_accepted, host, now, timing)
        return self.updates

    # ------------------------------------------------------------------ rows in and out
    def admit(self) -> None:
        """Waiting requests take the free rows; their prompts are prefilled."""
        start = time.perf_counter()
        free = min(self.capacity - len(self.requests), len(self.waiting))
        admitted = [self.rows[self.waiting.popleft()] for _ in range(free)]
        for row in admitted:
            row.admitted_at = start
        self.requests += [row.request for row in admitted]
        if self.drafter is not None and self.drafter.target_first_token:
            self._admit_after_first_token(admitted, start)
            return
        self.t_stream.admit([row.prompt[:-1] for row in admitted])
        if self.drafter is not None:
            self.drafter.admit([row.prompt for row in admitted])
        for row in admitted:
            row.pending = [row.prompt[-1]]
        sync(self.device)
        self.prefill_s += time.perf_counter() - start

    def _admit_after_first_token(self, admitted: list[RowState], start: float) -> None:
        """EAGLE: the target prefills the whole prompt and samples the first token; the
        head needs the features of every prompt position."""
        logits, features, valid = self.t_stream.admit([row.prompt for row in admitted])
        first = self.sampler.target(logits, admitted)[0].tolist()
        self.drafter.admit(
            [row.prompt + [f] for row, f in zip(admitted, first, strict=True)],
            [f[v] for f, v in zip(features, valid, strict=True)],
        )
        for i, row in enumerate(admitted):
            row.pending = [first[i]]
            if row.logprobs_k is not None:
                row.round_logprobs = logprob_entries(logits[i : i + 1], [first[i]], row.logprobs_k)
        sync(self.device)
        now = time.perf_counter()
        done = [self.emit(row, [f], now) for row, f in zip(admitted, first, strict=True)]
        self.prefill_s += now - start
        finished = [False] * (len(self.requests) - len(admitted)) + done
        if any(finished):
            self.remove(finished)

    def remove(self, finished: list[bool]) -> None:
        """Finished rows leave the batch (and both caches)."""
        keep = [i for i, f in enumerate(finished) if not f]
        self.requests = [self.requests[i] for i in keep]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.t_stream.select_rows(index)
        if self.drafter is not None:
            self.drafter.select_rows(keep, index)

    def emit(self, row: RowState, new: list[int], now: float) -> bool:
        """Append a request's new tokens (`RowState.take`); True when the request is done."""
        update = row.take(new, self.eos_token_id, now)
        self.updates.append(update)
        return update.finished

    # ------------------------------------------------------------------ one round
    def draft(self) -> tuple[Proposal, list[int] | None, bool, float]:
        """The round's drafts, as the policy plans them: (proposal [B, g], drafts each row
        proposes (None: g each), whether the policy's length was cut short, seconds).

        Without `cap_gamma` no row's length is cut to the tokens it may still generate, so
        that each row's random draws do not depend on the other rows (per-request seeds);
        the surplus is cut by `emit`.
        """
        rows = self.active_rows()
        plan = self.policy.plan_round(
            [row.remaining for row in rows],
            [row.acceptance_estimate for row in rows],
            self.cap_gamma,
        )
        if plan.steps == 0:
            none = torch.zeros(len(rows), 0, dtype=torch.long, device=self.device)
            return Proposal(none, []), plan.proposed(), False, 0.0
        start = time.perf_counter()
        proposal = self.drafter.propose(
            plan.steps, lambda logits: self.sampler.draft(logits, rows), plan.control
        )
        sync(self.device)
        return proposal, plan.proposed(), plan.limited(), time.perf_counter() - start

    def verify(self, proposal: Proposal, lengths: list[int] | None) -> tuple[torch.Tensor, list]:
        """The target scores [pending, d_1..d_g] in one pass and verifies the drafts (row i
        accepts at most lengths[i] of them).

        Returns (n_accepted [B], host rows [n_i, next_i, *drafts_i]) once on the host.
        """
        rows = self.active_rows()
        drafted, g = proposal.tokens, proposal.tokens.shape[1]
        tokens, valid = left_pad([row.pending for row in rows], self.device)
        if g > 0:
            tokens = torch.cat([tokens, drafted], dim=1)
            valid = torch.cat([valid, torch.ones_like(drafted, dtype=torch.bool)], dim=1)
        logits = self.t_stream.forward(tokens, valid, keep=g + 1)
        if g == 0:
            next_token, _ = self.sampler.target(logits[:, -1], rows)
            n_accepted = torch.zeros_like(next_token)
        else:
            ragged = None
            if lengths is not None and min(lengths) < g:
                ragged = torch.tensor(lengths, device=self.device)
            n_accepted, next_token = self.sampler.verify(
                logits, drafted, proposal.q, rows, lengths=ragged
            )
        host = torch.cat([n_accepted[:, None], next_token[:, None], drafted], dim=1).tolist()
        for i, row in enumerate(rows):
            if row.logprobs_k is not None:
                n_i, next_i, *drafts_i = host[i]
                row.round_logprobs = logprob_entries(
                    logits[i, : n_i + 1], drafts_i[:n_i] + [next_i], row.logprobs_k
                )
        sync(self.device)
        return n_accepted, host

    def commit(
        self,
        proposal: Proposal,
        lengths: list[int] | None,
        capped: bool,
        n_accepted: torch.Tensor,
        host: list,
        now: float,
        timing: tuple[float, float, float],
    ) -> None:
        """Append each row's accepted drafts and next token, record the round, roll both
        caches back to the committed tokens, and let finished rows go."""
        rows = self.active_rows()
        g = proposal.tokens.shape[1]
        starts = [len(row.outputs) for row in rows]
        accepted = [h[0] for h in host]
        proposed = lengths if lengths is not None else [g] * len(rows)
        confidence = None if proposal.confidence is None else proposal.confidence.tolist()
        committed, finished = [], []
        round_s = timing[2]
        for i, row in enumerate(rows):
            n_i, next_i, drafts_i = host[i][0], host[i][1], host[i][2:]
            before = len(row.outputs)
            finished.append(self.emit(row, drafts_i[:n_i] + [next_i], now))
            n_new = len(row.outputs) - before
            committed.append(n_new)
            row_confidence = None if confidence is None else confidence[i]
            if g > 0 or lengths is not None:  # a per-row policy counts target-only rounds
                row.stats.record(proposed[i], n_i, row_confidence)
            row.acceptance_estimate = self.policy.after_row(
                row.acceptance_estimate, proposed[i], n_i, row_confidence
            )
            if self.record:
                self.token_latency.extend([round_s / n_new] * n_new)
            # The target cached [pending, d_1..d_n]; the new token is pending.
            row.pending = [next_i]
        if self.record:
            self.rounds.append(
                Round(g, capped, list(self.requests), starts, accepted, committed, *timing, lengths)
            )
        self.policy.after_round(accepted, g, capped)

        self.t_stream.drop_last(g - n_accepted)
        if self.drafter is not None:
            features = self.t_stream.features
            self.drafter.commit(
                g, n_accepted, host, None if features is None else features[:, -(g + 1) :]
            )
        if any(finished):
            self.remove(finished)
