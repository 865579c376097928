"""The traffic record: one completed request, one JSON object per line of the traffic log
(docs/traffic.md, `SCHEMA_VERSION`). The schema is one pydantic model, `TrafficRecord`: the
writers (the server, `convert-traffic`) build it, the readers (`traffic_shards.read_traffic`,
the online job, `specdistill drift --traffic`) validate against it; `describe` turns a
validation error into one line naming the field and the value.
"""

import math
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from specdistill.errors import UserError

SCHEMA_VERSION = 1


class TrafficError(UserError):
    """A traffic record that does not follow the schema (file and line named)."""


# ----------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class Bounds:
    """The range of a numeric field (None: unbounded on that side)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def __call__(self, value):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise PydanticCustomError(
                "number", "is not a number (got {got})", {"got": _show(value)}
            )
        if isinstance(value, int) and abs(value) >= 2**1023 or not math.isfinite(value):
            raise PydanticCustomError("number", "is not finite (got {got})", {"got": _show(value)})
        if not self.contains(value):
            raise PydanticCustomError(
                "out_of_range", "{got} is not in {range}", {"got": _show(value), "range": str(self)}
            )
        return value

    def contains(self, value) -> bool:
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
        )

    def __str__(self) -> str:
        if self.ge is not None:
            low = f"[{self.ge:g}"
        else:
            low = "(-inf" if self.gt is None else f"({self.gt:g}"
        return f"{low}, {self.le:g}]" if self.le is not None else f"{low}, inf)"


def _show(value) -> str:
    return repr(value)[:60]


def number(bounds: Bounds = Bounds()) -> object:
    """A finite int or float (never a bool) within `bounds`; an int stays an int when written."""
    return Annotated[int | float, PlainValidator(bounds)]


TEMPERATURE = Bounds(ge=0.0, le=100.0)  # as the server accepts it (serve/schema.py)
TOP_P = Bounds(gt=0.0, le=1.0)
COUNT = Bounds(ge=0)
RATE = Bounds(ge=0.0, le=1.0)
LOGPROB = Bounds(le=1e-4)  # a log-probability (rounding a little above 0 allowed)
SECONDS = Bounds(ge=0.0)  # a time since the epoch, a latency
ENDPOINTS = ("completions", "chat.completions")
# What the server writes ("stop": EOS or a stop string) and what engines' logs carry.
FINISH_REASONS = ("stop", "length", "abort", "tool_calls", "content_filter")

Int = Annotated[int, Field(strict=True)]  # never a bool, a float or a string
Natural = Annotated[int, Field(strict=True, ge=0)]
Count = number(COUNT)
TopEntry = Annotated[list[tuple[Int, number(LOGPROB)]], Field(min_length=1)]


class _Open(BaseModel):
    """Unknown fields are kept (and written back) but never required: readers ignore them."""

    model_config = ConfigDict(extra="allow")


class Target(_Open):
    name: str
    identity: str


class SamplingRecord(_Open):
    temperature: number(TEMPERATURE)
    top_p: number(TOP_P) | None  # null or 1.0: off
    max_tokens: Annotated[int, Field(strict=True, ge=1)] | None
    seed: Int | None
    stop: list[str]


class SpeculativeRecord(_Open):
    """vLLM's per-request speculative statistics (`metrics.speculative_decoding`)."""

    mean_acceptance_length: Count | None
    draft_acceptance_rate: number(RATE) | None
    acceptance_histogram: list[Natural] | None
    num_spec_steps: Count | None
    num_draft_tokens: Count | None
    num_accepted_draft_tokens: Count | None


class TrafficRecord(_Open):
    """One completed request, schema version 1 (docs/traffic.md): what the server and
    `convert-traffic` write and what every reader validates."""

    schema_version: Literal[1]
    id: str
    time: number(SECONDS)
    endpoint: Literal[ENDPOINTS]
    target: Target
    draft_version: str | None
    sampling: SamplingRecord
    prompt: str | list
    prompt_token_ids: list[Int]
    completion_token_ids: list[Int]
    completion_text: str
    finish_reason: Literal[FINISH_REASONS]
    speculative: SpeculativeRecord
    category: str | None
    top_logprobs: list[TopEntry] | None
    latency_s: number(SECONDS)
    ttft_s: number(SECONDS) | None
    # `key-` + sha256(API key)[:12]; null: the server has no key; absent: convert-traffic
    client: Annotated[str, Field(pattern=r"^key-[0-9a-f]{12}$")] | None = None

    @model_validator(mode="after")
    def _consistent(self):
        top = self.top_logprobs
        if top is not None and len(top) != len(self.completion_token_ids):
            raise PydanticCustomError(
                "top_logprobs_length",
                "top_logprobs has {n} entries for {m} completion tokens (one per token)",
                {"n": len(top), "m": len(self.completion_token_ids)},
            )
        for i, entry in enumerate(top or ()):
            ids = [t for t, _ in entry]
            if len(set(ids)) != len(ids):
                raise PydanticCustomError(
                    "top_logprobs_range", "top_logprobs[{i}] repeats a token id", {"i": i}
                )
            if sum(math.exp(min(lp, 0.0)) for _, lp in entry) > 1.001:
                raise PydanticCustomError(
                    "top_logprobs_range", "top_logprobs[{i}]: probabilities sum above 1", {"i": i}
                )
        return self

    def line(self) -> bytes:
        """The record as one JSON line (newline included); fields left unset are not written."""
        return self.model_dump_json(exclude_unset=True).encode() + b"\n"


def describe(error: dict) -> str:
    """One pydantic error as `field.path: what (value)`."""
    where = ".".join(str(p) for p in error["loc"]) or "record"
    if error["type"] == "missing":
        return f"field {where!r} missing"
    message = error["msg"]
    if error["type"] in ("number", "out_of_range") or "input" not in error:
        return f"{where}: {message}"
    return f"{where}: {message} (got {_show(error['input'])})"


def check(record) -> tuple[TrafficRecord | None, list[dict]]:
    """(the model, []) for a record that follows the schema, else (None, pydantic's errors)."""
    if not isinstance(record, dict):
        kind = type(record).__name__
        return None, [
            {"loc": (), "type": "model_type", "msg": f"a record is a JSON object, got {kind}"}
        ]
    try:
        return TrafficRecord.model_validate(record), []
    except ValidationError as e:
        return None, e.errors(include_url=False)


def parse_record(record) -> TrafficRecord:
    """The model of `record` (a parsed JSON line); TrafficError naming the field and value
    unless it follows schema version 1."""
    if isinstance(record, dict) and record.get("schema_version") != SCHEMA_VERSION:
        version = record.get("schema_version")
        raise TrafficError(f"schema_version {version!r} is not {SCHEMA_VERSION}")
    model, errors = check(record)
    if model is None:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise TrafficError(describe(errors[0]) + more)
    return model


def validate(record: dict) -> dict:
    """`record` unchanged once `parse_record` finds it follows the schema (TrafficError
    otherwise)."""
    parse_record(record)
    return record
