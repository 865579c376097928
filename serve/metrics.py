"""Prometheus metrics with vLLM's meanings (`specdistill:` prefix), one registry per app.

Beyond vLLM's: the draft-length policy's series. `spec_decode_drafted_length` is a histogram
of the drafts each row proposed per round (buckets 0..max_gamma; 0 is a target-only round
for that row, also counted by `spec_decode_num_target_only_rounds`), and the acceptance
head's calibration in service: `spec_decode_mean_predicted_acceptance` against
`spec_decode_mean_realised_acceptance`, over every draft verification reached (accepted or
the first rejection) that had a prediction, since start-up.
"""

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from specdistill.serve.worker import LengthTally

PREFIX = "specdistill:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """Prometheus metrics with vLLM's meanings, in a registry of their own (one per app)."""

    def __init__(self, max_gamma: int):
        disable_created_metrics()  # no `_created` series next to each counter
        r = self.registry = CollectorRegistry()
        self.num_drafts = Counter(
            PREFIX + "spec_decode_num_drafts",
            "Speculative rounds (one draft each) per row.",
            registry=r,
        )
        self.num_draft_tokens = Counter(
            PREFIX + "spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r
        )
        self.num_accepted_tokens = Counter(
            PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r
        )
        self.accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0-based).",
            ["position"],
            registry=r,
        )
        self.drafted_length = Histogram(
            PREFIX + "spec_decode_drafted_length",
            "Drafts a row proposed per round (0: a target-only round for the row).",
            buckets=tuple(range(max_gamma + 1)),
            registry=r,
        )
        self.target_only_rounds = Counter(
            PREFIX + "spec_decode_num_target_only_rounds",
            "Rounds (per row) without drafts: the length policy judged drafting not to pay.",
            registry=r,
        )
        self.predicted_sum = 0.0
        self.reached = 0
        self.reached_accepted = 0
        self.mean_predicted = Gauge(
            PREFIX + "spec_decode_mean_predicted_acceptance",
            "Mean predicted acceptance of the drafts verification reached (NaN: none yet).",
            registry=r,
        )
        self.mean_realised = Gauge(
            PREFIX + "spec_decode_mean_realised_acceptance",
            "Fraction of the drafts verification reached (with a prediction) that were accepted.",
            registry=r,
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens.", registry=r
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens.", registry=r)
        self.request_success = Counter(
            PREFIX + "request_success", "Completed requests.", ["finished_reason"], registry=r
        )
        self.latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Request latency (arrival to last token).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge(PREFIX + "num_requests_running", "Requests in flight.", registry=r)
        self.draft_version = Gauge(
            PREFIX + "draft_version",
            "Published draft version number (0: none or unversioned).",
            registry=r,
        )
        self.draft_info = Gauge(
            PREFIX + "draft_version_info",
            "The draft version serving new requests (value 1).",
            ["version"],
            registry=r,
        )

    def finished(
        self,
        stats: dict,
        n_prompt: int,
        n_out: int,
        reason: str,
        latency,
        ttft,
        tally: LengthTally | None = None,
    ):
        self.num_drafts.inc(stats["num_spec_steps"])
        self.num_draft_tokens.inc(stats["num_draft_tokens"])
        self.num_accepted_tokens.inc(stats["num_accepted_draft_tokens"])
        for pos, n in enumerate(stats["acceptance_histogram"]):
            self.accepted_per_pos.labels(position=str(pos)).inc(n)
        for k, n in enumerate(stats.get("drafted_length_histogram") or []):
            for _ in range(n):
                self.drafted_length.observe(k)
            if k == 0:
                self.target_only_rounds.inc(n)
        if tally is not None:
            self.predicted_sum += tally.predicted_sum
            self.reached += tally.reached
            self.reached_accepted += tally.reached_accepted
        self.generation_tokens.inc(n_out)
        self.prompt_tokens.inc(n_prompt)
        self.request_success.labels(finished_reason=reason).inc()
        self.latency.observe(latency)
        if ttft is not None:
            self.ttft.observe(ttft)

    def expose(self, version: str | None) -> bytes:
        self.draft_version.set(int(version[1:]) if version and _is_version(version) else 0)
        self.draft_info.clear()
        self.draft_info.labels(version=version or "none").set(1)
        nan = float("nan")
        self.mean_predicted.set(self.predicted_sum / self.reached if self.reached else nan)
        self.mean_realised.set(self.reached_accepted / self.reached if self.reached else nan)
        return generate_latest(self.registry)


def _is_version(v: str) -> bool:
    return len(v) == 7 and v[0] == "v" and v[1:].isdigit()
