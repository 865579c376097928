"""What the online job keeps of a traffic record: enough to train and evaluate on it. The
store holds these (train/online/store.py), a refresh trains on them, joining its batches'
rows to them by dataset index (`batch["sequence"]`: the sparse targets, train/online/sparse.py;
each row's served sampling, train/temperatures.py `TrafficShares`), and the gate scores them.
"""

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from specdistill.data.tokenize import Tokens
from specdistill.formats.traffic import TrafficRecord

# One top_logprobs entry per completion token: (token id, log-probability) of the target's
# raw top-k at temperature 1 (docs/traffic.md).
TopLogprobs = list[list[tuple[int, float]]]


@dataclass(frozen=True)
class KeptRecord:
    """One screened record (train/online/screen.py): its ids, its time and category, the
    sampling it was served with, and its top_logprobs when the job trains on them
    (online.sparse_targets)."""

    id: str
    time: float
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    temperature: float
    top_p: float | None = None  # None or 1: off
    category: str | None = None
    top_logprobs: TopLogprobs | None = None

    @classmethod
    def of(cls, record: TrafficRecord, top_logprobs: bool = False) -> "KeptRecord":
        """What the store keeps of `record` (its top_logprobs only when `top_logprobs`)."""
        return cls(
            id=record.id,
            time=record.time,
            prompt_token_ids=record.prompt_token_ids,
            completion_token_ids=record.completion_token_ids,
            temperature=float(record.sampling.temperature),
            top_p=record.sampling.top_p,
            category=record.category,
            top_logprobs=(record.top_logprobs or None) if top_logprobs else None,
        )

    def as_dict(self) -> dict:
        """The record in the job's committed state (OUT/state); `from_dict` reads it back."""
        fields = {
            "id": self.id,
            "time": self.time,
            "prompt_token_ids": self.prompt_token_ids,
            "completion_token_ids": self.completion_token_ids,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "category": self.category,
        }
        if self.top_logprobs:
            fields["top_logprobs"] = self.top_logprobs
        return fields

    @classmethod
    def from_dict(cls, fields: dict) -> "KeptRecord":
        return cls(**fields)

    def tokens(self) -> Tokens:
        """Prompt + completion ids; the loss mask is True on the completion tokens."""
        p, c = self.prompt_token_ids, self.completion_token_ids
        ids = np.array(p + c, dtype=np.int32)
        mask = np.zeros(len(ids), dtype=bool)
        mask[len(p) :] = True
        mask[0] = False
        return Tokens(ids, mask)

    def key(self) -> str:
        """What makes two records the same: their prompt and completion token ids."""
        ids = [self.prompt_token_ids, self.completion_token_ids]
        return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:32]

    def prompt_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.prompt_token_ids).encode()).hexdigest()[:32]
