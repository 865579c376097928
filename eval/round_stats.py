"""What the speculative decoding engine records: one `Round` per verification round, one
`Update` per request and step, one `SpecStats` per request (eval/batch.py)."""

from dataclasses import dataclass, field


@dataclass
class Round:
    """One verification round. Lists are per active row, in `requests` order."""

    gamma: int  # draft steps this round (0: target-only step)
    capped: bool  # γ was shortened because the rows needed fewer tokens
    requests: list[int]
    starts: list[int]  # tokens each row had generated before this round
    accepted: list[int]  # drafts accepted per row (n, 0 ≤ n ≤ its proposed drafts)
    committed: list[int]  # tokens appended per row (after max_new_tokens / EOS cuts)
    draft_s: float
    verify_s: float
    round_s: float
    drafted: list[int] | None = None  # drafts each row proposed (None: γ each)

    def row_gammas(self) -> list[int]:
        """Drafts each row proposed this round."""
        return list(self.drafted) if self.drafted is not None else [self.gamma] * len(self.requests)


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
    proposal, accepted tokens exclude the bonus / correction token; `as_dict`), and those
    of the draft-length policy (`length_dict`): how many rounds proposed k drafts, and the
    mean predicted acceptance of the drafts verification reached (accepted or the first
    rejection) against the fraction of them accepted."""

    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)  # accepted per position
    drafted_histogram: list[int] = field(default_factory=list)  # rounds per drafted length
    predicted_sum: float = 0.0  # Σ predicted acceptance over the drafts verification reached
    reached: int = 0  # drafts verification reached (with a prediction)
    reached_accepted: int = 0  # of those, accepted

    def record(self, gamma: int, n_accepted: int, predicted: list[float] | None = None) -> None:
        """One round of γ ≥ 0 drafts, n of them accepted; `predicted`: the drafts' predicted
        acceptances (when the policy had them)."""
        if len(self.drafted_histogram) <= gamma:
            self.drafted_histogram += [0] * (gamma + 1 - len(self.drafted_histogram))
        self.drafted_histogram[gamma] += 1
        if gamma == 0:
            return
        self.num_spec_steps += 1
        self.num_draft_tokens += gamma
        self.num_accepted_draft_tokens += n_accepted
        if len(self.acceptance_histogram) < gamma:
            self.acceptance_histogram += [0] * (gamma - len(self.acceptance_histogram))
        for j in range(n_accepted):
            self.acceptance_histogram[j] += 1
        if predicted is not None:
            seen = min(n_accepted + 1, gamma)
            self.predicted_sum += sum(predicted[:seen])
            self.reached += seen
            self.reached_accepted += n_accepted

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

    def length_dict(self) -> dict:
        """The draft-length statistics (None where there is no data)."""
        rounds = sum(self.drafted_histogram)
        drafted = sum(k * n for k, n in enumerate(self.drafted_histogram))
        return {
            "drafted_length_histogram": list(self.drafted_histogram),
            "mean_drafted_length": drafted / rounds if rounds else None,
            "mean_predicted_acceptance": self.predicted_sum / self.reached
            if self.reached
            else None,
            "mean_realised_acceptance": self.reached_accepted / self.reached
            if self.reached
            else None,
        }
