"""Screening one line of traffic for the online job: the traffic schema (formats/traffic.py
`TrafficRecord`: types, finite numbers, sampling and speculative ranges, top_logprobs shape),
then the job's own rules: its clients, its target, its token budget and vocabulary. `screen`
never raises: any line (bytes of any kind, JSON of any shape) gets a reason.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

from specdistill.formats.traffic import TrafficRecord, check, describe
from specdistill.formats.traffic_shards import shards
from specdistill.train.online.kept import KeptRecord

SKIP_REASONS = ("client",)  # screened out by choice: counted, not written to rejects.jsonl
# A positive temperature below MIN_TEMPERATURE overflows logits / T in low precision (the
# schema's own range, `formats.traffic.TEMPERATURE`, bounds it above). 0 is greedy.
MIN_TEMPERATURE = 1e-4
MAX_ID_CHARS = 256  # a record's id and category: kept in the state, keys of the gate's groups
# The reject reason of a schema error found under a field (any error, its type included);
# elsewhere an out-of-range value of these fields has its own reason, everything else is
# "schema". Errors of a reason other than "schema" are reported after the job's checks.
REASON_OF_FIELD = {"sampling": "sampling", "speculative": "speculative"}
RANGE_REASONS = {"top_logprobs": "top_logprobs"}
RANGE_ERRORS = ("out_of_range", "too_short")
TYPE_REASONS = {"top_logprobs_range": "top_logprobs"}  # the record's own cross-field checks


@dataclass(frozen=True)
class Screened:
    """What `screen` made of one line: `record` (None: the line is not a record that follows
    the schema) and, unless it is usable, why not (`reason`, `detail`). `id`: the line's own
    "id" value, whatever it is (named in rejects.jsonl)."""

    record: TrafficRecord | None = None
    reason: str | None = None
    detail: str = ""
    id: object = None


@dataclass(frozen=True)
class Envelope:
    """The fields of a record the job checks before the ranges of its sampling, speculative
    counters and top_logprobs: who sent it, for which target, how many tokens."""

    client: str | None
    target_name: str
    identity: str
    n_prompt: int
    n_completion: int

    @classmethod
    def of(cls, record: TrafficRecord) -> "Envelope":
        return cls(
            record.client,
            record.target.name,
            record.target.identity,
            len(record.prompt_token_ids),
            len(record.completion_token_ids),
        )

    @classmethod
    def of_fields(cls, fields: dict) -> "Envelope":
        """The envelope of a parsed line whose only schema errors lie in the fields checked
        after it (those fields of `fields` follow the schema)."""
        return cls(
            fields.get("client"),
            fields["target"]["name"],
            fields["target"]["identity"],
            len(fields["prompt_token_ids"]),
            len(fields["completion_token_ids"]),
        )


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} overflows a float")
    return value


def parse_line(raw: bytes):
    """json.loads, strict: NaN, Infinity and numbers that overflow a float are refused (a
    ValueError, as for any malformed line); so is nesting too deep for the parser."""
    try:
        return json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _reason(error: dict) -> str:
    """The reject reason of one of `TrafficRecord`'s validation errors."""
    loc = error["loc"]
    if error["type"] in TYPE_REASONS:
        return TYPE_REASONS[error["type"]]
    if error["type"] == "missing" or not loc:
        return "schema"
    if loc[0] in REASON_OF_FIELD:
        return REASON_OF_FIELD[loc[0]]
    if error["type"] in RANGE_ERRORS:
        return RANGE_REASONS.get(loc[0], "schema")
    return "schema"


def _envelope_problem(
    envelope: Envelope, identity: str, max_tokens: int, clients
) -> tuple[str, str] | None:
    """(reason, detail) for a record of a client the job skips, of another target, without a
    prompt or a completion, or over the token budget."""
    if clients and envelope.client not in clients:
        return "client", f"client {envelope.client!r} is not in online.clients"
    if envelope.identity != identity:
        return (
            "target_identity",
            f"record of target {envelope.target_name!r} ({envelope.identity}), "
            f"job's target is {identity}",
        )
    if envelope.n_completion == 0:
        return "empty_completion", ""
    if envelope.n_prompt == 0:
        return "empty_prompt", ""
    n = envelope.n_prompt + envelope.n_completion
    if n > max_tokens:
        return "oversized", f"{n} tokens > {max_tokens}"
    return None


def _policy_problem(record: TrafficRecord, vocab_size: int) -> tuple[str, str] | None:
    """(reason, detail) for what follows the schema but the job cannot keep or train on: an
    empty or over-long id or category, a positive temperature too small for low precision, a
    token id outside the target's vocabulary (top_logprobs ids included: the one check of
    their range; the schema checks that they are distinct)."""
    if not 0 < len(record.id) <= MAX_ID_CHARS:
        return "schema", f"id of {len(record.id)} characters (1 to {MAX_ID_CHARS})"
    if record.category is not None and len(record.category) > MAX_ID_CHARS:
        return "schema", f"category of {len(record.category)} characters (> {MAX_ID_CHARS})"
    t = record.sampling.temperature
    if 0 < t < MIN_TEMPERATURE:
        return "sampling", f"sampling.temperature {t!r} is not 0 or >= {MIN_TEMPERATURE:g}"
    ids = record.prompt_token_ids + record.completion_token_ids
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        return "token_out_of_range", f"ids must be in [0, {vocab_size})"
    for i, entry in enumerate(record.top_logprobs or ()):
        bad = [t_id for t_id, _ in entry if not 0 <= t_id < vocab_size]
        if bad:
            return "top_logprobs", f"top_logprobs[{i}]: id {bad[0]!r} not in [0, {vocab_size})"
    return None


def screen(
    raw: bytes, identity: str, *, max_tokens: int, vocab_size: int, clients=None
) -> Screened:
    """The record of a usable line (`Screened.reason` None), or why the line is not usable.

    Checked in this order: the schema's type errors (reason "schema"), the envelope (clients,
    target, token counts), the schema's range errors (sampling, speculative, top_logprobs),
    then the job's policy. `clients`: a set of client ids; a record from another client (or
    none) gets the reason "client" (one of SKIP_REASONS). None or empty: every client."""
    if not raw.strip():
        return Screened(reason="blank_line")
    try:
        parsed = parse_line(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN, overflow, depth
        return Screened(reason="malformed_json", detail=str(e)[:500])
    line_id = parsed.get("id") if isinstance(parsed, dict) else None
    try:
        record, errors = check(parsed)
    except (TypeError, ValueError, OverflowError) as e:  # a shape no validator foresaw
        return Screened(reason="schema", detail=str(e)[:500], id=line_id)
    found = [(_reason(e), describe(e)[:500]) for e in errors]
    schema = [f for f in found if f[0] == "schema"]
    if schema:
        return Screened(None, *schema[0], id=line_id)
    envelope = Envelope.of(record) if record is not None else Envelope.of_fields(parsed)
    problem = _envelope_problem(envelope, identity, max_tokens, clients)
    if problem is None and found:
        problem = found[0]
    if problem is None:
        problem = _policy_problem(record, vocab_size)
    if problem is not None:
        return Screened(record, *problem, id=line_id)
    return Screened(record, id=line_id)


def load_anchor(sources: list[str], identity: str, max_tokens: int, vocab_size: int) -> list:
    """The anchor set: the usable records of traffic directories or .jsonl files."""
    items = []
    for source in sources:
        path = Path(source)
        files = shards(path) if path.is_dir() else [path]
        for f in files:
            for raw in f.read_bytes().split(b"\n"):
                screened = screen(raw, identity, max_tokens=max_tokens, vocab_size=vocab_size)
                if screened.reason is None:
                    items.append(KeptRecord.of(screened.record))
    return items
