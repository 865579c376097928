"""Token choice for the speculative decoding engine (eval/engine.py, eval/batch.py).

The target samples from p (temperature, top-k, top-p); the draft from q = softmax(draft
logits / T), unfiltered (docs/theory.md §1); verification (eval/verify.py) uses the very q
each draft was drawn from, so the output is distributed exactly as sampling from the
processed target. `Sampler` samples every row of a batch alike with one generator
(`generate`); `RowSampler` samples each row with its own `Sampling` and generator
(`Engine`). Both take the rows' `RowState`s (eval/batch.py) next to the logits.

A temperature below `GREEDY_BELOW` (1e-5, 0 included) is greedy: argmax, as vLLM and
SGLang decode a temperature near 0. Logits divided by a subnormal one overflow to infinity,
and softmax of those is NaN.
"""

import os
from dataclasses import dataclass

import torch

from specdistill.eval import verify
from specdistill.losses.sampling import check_filters, probabilities

GREEDY_BELOW = 1e-5


def is_greedy(temperature: float) -> bool:
    """Whether `temperature` decodes greedily (below `GREEDY_BELOW`)."""
    return temperature < GREEDY_BELOW


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


class Sampler:
    """Token choice at the run's temperature, argmax when greedy (`is_greedy`), with one
    generator.

    The target samples from p (temperature, top-k, top-p); the draft from q (temperature
    only): docs/theory.md §1. `rows` (the logits' rows' states) is unused: every row of a
    `generate` call samples alike (`RowSampler` is the per-request one).
    """

    def __init__(self, temperature: float, top_p, top_k, generator: torch.Generator):
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.generator = generator
        self.greedy = is_greedy(temperature)

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

    def verify(
        self, logits, drafted, q, rows=None, lengths=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Verification of γ ≥ 1 drafts: logits [B, γ+1, V] -> (n_accepted [B], next [B]).
        lengths [B]: drafts each row proposes (None: all γ; eval/verify.py)."""
        ragged = {} if lengths is None else {"lengths": lengths}
        if self.greedy:
            return verify.verify_greedy(logits, drafted, **ragged)
        q = torch.stack(q, dim=1)
        return verify.verify_sampled(self.p(logits), q, drafted, self.generator, **ragged)

    def _sample(self, logits, distribution):
        if self.greedy:
            return logits.argmax(-1), None
        probs = distribution(logits)
        return verify.draw(probs, self.generator), probs


class RowSampler:
    """Per-request sampling: each row has its own temperature / top-p / top-k and its own
    torch.Generator (seeded by the request, `generator_for`), so a seeded request draws the
    same random numbers whatever else shares the batch (with γ never shortened:
    `cap_gamma=False`).

    Greedy rows are verified together (argmax); each sampled row on its own, with its own
    generator. Verification stays lossless row by row (docs/theory.md §2). `rows` are the
    `RowState`s of the logits' rows, in order; each carries `sampling` and `generator`.
    """

    def __init__(self, device: torch.device):
        self.device = device

    def generator_for(self, sampling: Sampling) -> torch.Generator | None:
        """A sampled request's generator (its seed, or a random one); None when greedy."""
        if is_greedy(sampling.temperature):
            return None
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(7))
        return torch.Generator(device=self.device).manual_seed(seed)

    def target(self, logits: torch.Tensor, rows) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._sample(logits, rows, filtered=True)

    def draft(self, logits: torch.Tensor, rows) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._sample(logits, rows, filtered=False)

    def _sample(self, logits, rows, *, filtered: bool):
        tokens = logits.argmax(-1)
        probs = None
        for i, row in enumerate(rows):
            s = row.sampling
            if is_greedy(s.temperature):
                continue
            filters = (s.top_p, s.top_k) if filtered else ()
            p = probabilities(logits[i : i + 1], s.temperature, *filters)
            if probs is None:
                probs = torch.zeros(logits.shape, dtype=p.dtype, device=logits.device)
            probs[i] = p[0]
            tokens[i] = verify.draw(p, row.generator)[0]
        return tokens, probs

    def verify(self, logits, drafted, q, rows, lengths=None) -> tuple[torch.Tensor, torch.Tensor]:
        """lengths [B]: drafts each row proposes (None: all γ); a sampled row is verified on
        its own proposed drafts only, so its random draws do not depend on other rows."""
        ragged = {} if lengths is None else {"lengths": lengths}
        n_accepted, next_token = verify.verify_greedy(logits, drafted, **ragged)
        for i, row in enumerate(rows):
            s = row.sampling
            if is_greedy(s.temperature):
                continue
            k = drafted.shape[1] if lengths is None else int(lengths[i])
            p = probabilities(logits[i : i + 1, : k + 1], s.temperature, s.top_p, s.top_k)
            if k == 0:
                q_i = p.new_zeros(1, 0, p.shape[-1])
            else:
                q_i = torch.stack([step[i : i + 1] for step in q[:k]], dim=1)
            n, nxt = verify.verify_sampled(p, q_i, drafted[i : i + 1, :k], row.generator)
            n_accepted[i], next_token[i] = n[0], nxt[0]
        return n_accepted, next_token


def logprob_entries(logits: torch.Tensor, tokens: list[int], k: int) -> list:
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
