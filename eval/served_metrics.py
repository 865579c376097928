"""Served acceptance read from a running vLLM: its Prometheus counters (`GET /metrics`) at
one moment (`ServedCounters`), and what happened between two readings (`ServedWindow`):
drafts, per-position acceptance, mean accepted length, per-token α and tokens/s.

    before = scrape("http://127.0.0.1:8000")
    ...                                          # traffic
    window = ServedWindow.between(before, scrape("http://127.0.0.1:8000"))
    window.mean_accepted_length, window.per_position, window.alpha

The counters are vLLM's (`vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
`..._num_accepted_tokens_total`, `..._num_accepted_tokens_per_pos_total{position}`,
`vllm:generation_tokens_total`), summed over engines and models; a server that restarted
(counters smaller than before) gives a window measured from zero. Per-position acceptance is
vLLM's accepted-at-position j over drafts (a rate of rounds, unconditional); α is
`eval.stats.alpha_from_counts` over the window's rounds, the figure the trainer predicts.
"""

import math
import time
import urllib.request
from dataclasses import asdict, dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from specdistill.errors import UserError
from specdistill.eval.stats import alpha_from_counts

PREFIX = "vllm:"
NAMES = {  # the counters' family names, as the parser reports them (no "_total")
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
    "vllm:generation_tokens": "generated",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
MAX_BYTES = 4 << 20  # a metrics page larger than this is refused, not read


class MetricsError(UserError):
    """The metrics page could not be read or parsed."""


@dataclass
class ServedCounters:
    """vLLM's speculation and generation counters at `time` (seconds since the epoch)."""

    time: float
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    generated: int = 0
    per_position: list[int] = field(default_factory=list)


def parse(text: str, at: float | None = None) -> ServedCounters:
    """A Prometheus text page -> the counters (absent ones are 0: a server without a draft)."""
    counters = ServedCounters(time=time.time() if at is None else at)
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError) as e:
        raise MetricsError(f"not a Prometheus text page: {e}") from e
    for family in families:
        for sample in family.samples:
            if not sample.name.endswith("_total") or not math.isfinite(sample.value):
                continue
            if family.name in NAMES:
                name = NAMES[family.name]
                setattr(counters, name, getattr(counters, name) + int(sample.value))
            elif family.name == PER_POSITION:
                j = int(sample.labels.get("position", -1))
                if j < 0:
                    continue
                hist = counters.per_position
                hist += [0] * (j + 1 - len(hist))
                hist[j] += int(sample.value)
    return counters


def scrape(url: str, timeout: float = 10.0) -> ServedCounters:
    """GET URL/metrics and parse it; `MetricsError` when the server does not answer."""
    at = time.time()
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as response:
            body = response.read(MAX_BYTES + 1)
    except OSError as e:
        raise MetricsError(f"{url}/metrics: {e}") from e
    if len(body) > MAX_BYTES:
        raise MetricsError(f"{url}/metrics: larger than {MAX_BYTES} bytes")
    return parse(body.decode("utf-8", errors="replace"), at)


@dataclass
class ServedWindow:
    """What a server did between two readings: its rounds with a draft (`drafts`), draft
    tokens proposed and accepted, the accepted-at-position counts, and tokens generated."""

    start: float
    end: float
    drafts: int
    draft_tokens: int
    accepted: int
    generated: int
    accepted_per_position: list[int]

    @classmethod
    def between(cls, before: ServedCounters, after: ServedCounters) -> "ServedWindow":
        if after.drafts < before.drafts or after.generated < before.generated:
            before = ServedCounters(time=before.time)  # restarted: counted from zero
        n = len(after.per_position)
        old = before.per_position + [0] * (n - len(before.per_position))
        return cls(
            start=before.time,
            end=after.time,
            drafts=after.drafts - before.drafts,
            draft_tokens=after.draft_tokens - before.draft_tokens,
            accepted=after.accepted - before.accepted,
            generated=after.generated - before.generated,
            accepted_per_position=[a - b for a, b in zip(after.per_position, old, strict=True)],
        )

    @property
    def per_position(self) -> list[float | None]:
        """Accepted at position j over rounds (None without rounds)."""
        return [a / self.drafts if self.drafts else None for a in self.accepted_per_position]

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per round: 1 + accepted drafts per round (vLLM's mean acceptance length)."""
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def alpha(self) -> float | None:
        if not self.drafts or not self.draft_tokens:
            return None
        return alpha_from_counts(self.drafts, self.draft_tokens, self.accepted)

    @property
    def tokens_per_s(self) -> float | None:
        seconds = self.end - self.start
        return self.generated / seconds if seconds > 0 else None

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "per_position": self.per_position,
            "mean_accepted_length": self.mean_accepted_length,
            "alpha": self.alpha,
            "tokens_per_s": self.tokens_per_s,
        }
