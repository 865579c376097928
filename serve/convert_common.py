"""What the converters of serve/convert.py share: the checks a source entry passes before it
becomes a traffic record (sampling parameters in range, finite numbers, non-negative counts,
bounded nesting), the record's assembly, and the reading of JSON lines from bytes.
"""

import hashlib
import json
import math
import re
import time
from pathlib import Path

from pydantic import ValidationError

from specdistill.data.records import lone_surrogate
from specdistill.errors import UserError
from specdistill.formats.traffic import (
    SCHEMA_VERSION,
    TEMPERATURE,
    TOP_P,
    TrafficRecord,
    describe,
)

MAX_DEPTH = 64  # nesting of a source entry (lists, objects, pickled attribute bags)


class ConvertError(UserError):
    """A source record that cannot become a traffic record (the reason is the message)."""


def count(value, name: str) -> int:
    """A non-negative integer count (a float with an integral value is accepted)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConvertError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise ConvertError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def finite(value, name: str, *, low: float | None = None) -> float | None:
    """None, or a finite float (>= `low` when given)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConvertError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or (low is not None and value < low):
        bound = "" if low is None else f" >= {low:g}"
        raise ConvertError(f"{name} must be a finite number{bound}, got {value!r}")
    return float(value)


def speculative_stats(
    num_spec_steps, num_draft_tokens, num_accepted, histogram: list | None
) -> dict:
    """The speculative statistics in the record's (vLLM's) shape; counts are checked
    (non-negative integers, accepted <= drafted)."""
    steps = count(num_spec_steps, "num_spec_steps")
    drafted = count(num_draft_tokens, "num_draft_tokens")
    accepted = count(num_accepted, "num_accepted_draft_tokens")
    if accepted > drafted:
        raise ConvertError(
            f"num_accepted_draft_tokens {accepted} exceeds num_draft_tokens {drafted}"
        )
    if histogram is not None and not isinstance(histogram, list):
        raise ConvertError(f"acceptance_histogram must be a list, got {type(histogram).__name__}")
    return {
        "mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": [count(n, "acceptance_histogram entry") for n in (histogram or [])],
        "num_spec_steps": steps,
        "num_draft_tokens": drafted,
        "num_accepted_draft_tokens": accepted,
    }


NO_SPECULATION = speculative_stats(0, 0, 0, [])


def record(
    *,
    rid: str,
    endpoint: str,
    target: dict,
    sampling: dict,
    prompt,
    prompt_ids: list[int],
    completion_ids: list[int],
    completion_text: str,
    finish_reason: str,
    speculative: dict,
    category: str | None,
    top_logprobs: list | None,
    created: float | None,
    latency_s: float | None,
) -> dict:
    """The traffic record, validated by `TrafficRecord` (ConvertError naming the field), as
    the dict the log appends; no `client` field (the engine's logs name none)."""
    fields = dict(
        schema_version=SCHEMA_VERSION,
        id=rid,
        time=finite(created, "created", low=0) if created is not None else time.time(),
        endpoint=endpoint,
        target=target,
        draft_version=None,  # the serving engine's own draft: not named in its logs
        sampling=sampling,
        prompt=prompt,
        prompt_token_ids=[int(t) for t in prompt_ids],
        completion_token_ids=[int(t) for t in completion_ids],
        completion_text=completion_text,
        finish_reason=finish_reason or "stop",
        speculative=speculative,
        category=category,
        top_logprobs=top_logprobs,
        latency_s=finite(latency_s, "latency_s", low=0) or 0.0,
        ttft_s=None,
    )
    try:
        return TrafficRecord(**fields).model_dump(exclude_unset=True)
    except ValidationError as e:
        raise ConvertError(describe(e.errors(include_url=False)[0])) from None


def sampling_params(params: dict) -> dict:
    """The record's sampling parameters, range-checked as the server checks a request's:
    temperature finite and in `traffic.TEMPERATURE`, top_p in `traffic.TOP_P`, max_tokens a
    positive integer or absent, seed an integer or absent, stop a string or a list of strings."""
    if not isinstance(params, dict):
        raise ConvertError(f"sampling parameters must be an object, got {type(params).__name__}")
    temperature = params.get("temperature")
    temperature = 1.0 if temperature is None else finite(temperature, "temperature", low=0)
    if not TEMPERATURE.contains(temperature):
        raise ConvertError(f"temperature must be in {TEMPERATURE}, got {temperature!r}")
    top_p = params.get("top_p")
    top_p = 1.0 if top_p is None else finite(top_p, "top_p")
    if not TOP_P.contains(top_p):  # 0 included: what an engine did with it is not known
        raise ConvertError(f"top_p must be in {TOP_P}, got {top_p!r}")
    max_tokens = params.get("max_tokens", params.get("max_new_tokens"))
    if max_tokens is not None:
        max_tokens = count(max_tokens, "max_tokens")
        if max_tokens < 1:
            raise ConvertError("max_tokens must be >= 1, got 0")
    seed = params.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConvertError(f"seed must be an integer, got {seed!r}")
    stop = params.get("stop")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(x, str) for x in stop):
        raise ConvertError("stop must be a string or a list of strings")
    return {
        "temperature": temperature,
        "top_p": top_p,
        "max_tokens": max_tokens,
        "seed": seed,
        "stop": stop,
    }


TOKEN_ID = re.compile(r"token_id:(\d{1,9})")


def category(request: dict) -> str | None:
    meta = request.get("metadata") or {}
    return meta.get("category") or request.get("category")


def token_ids(tokenizer, tokens: list[str]) -> list[int]:
    """Token strings (as engines print them in logprobs) -> ids: "token_id:N" (vLLM's
    `--return-tokens-as-token-ids`, exact: decoded strings can be empty or collide) is N;
    byte-level BPE strings map directly, anything else is encoded."""
    ids = tokenizer.convert_tokens_to_ids(tokens)
    unk = tokenizer.unk_token_id
    out = []
    for token, i in zip(tokens, ids, strict=True):
        given = TOKEN_ID.fullmatch(token) if isinstance(token, str) else None
        if given is not None:
            if int(given.group(1)) >= len(tokenizer):
                raise ConvertError(f"logprob token {token!r} is outside the target's vocabulary")
            out.append(int(given.group(1)))
            continue
        if i is None or (unk is not None and i == unk and token != tokenizer.unk_token):
            encoded = tokenizer.encode(token, add_special_tokens=False)
            if len(encoded) != 1:
                raise ConvertError(f"logprob token {token!r} is not one token of the target")
            i = encoded[0]
        out.append(int(i))
    return out


class AttrBag:
    """Stands in for any class a pickle names: keeps the state it is given, runs nothing."""

    def __init__(self, *args, **kwargs):
        self._args = args

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)

    def get(self, key, default=None):
        return self.__dict__.get(key, default)


def plain(value, depth: int = 0):
    """_Bags -> dicts, recursively (so the converter reads dumps and JSON alike); refuses
    nesting deeper than MAX_DEPTH (a self-referencing pickle included) and a string or key
    that holds a lone surrogate."""
    if depth > MAX_DEPTH:
        raise ConvertError(f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, AttrBag):
        value = {k: v for k, v in value.__dict__.items() if k != "_args"}
    if isinstance(value, str):
        return text(value)
    if isinstance(value, dict):
        return {text(k) if isinstance(k, str) else k: plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v, depth + 1) for v in value]
    return value


def text(value: str) -> str:
    """`value`, unless it holds a lone surrogate (ConvertError: it is not text)."""
    if lone_surrogate(value) is not None:
        raise ConvertError(f"a string holds a lone surrogate (not text: {value[:40]!r})")
    return value


def lines(path: Path):
    """(line number, bytes) of a file's non-blank lines, split at b"\n" only."""
    for number, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        if raw.strip():
            yield number, raw


def json_line(raw: bytes):
    """A line's JSON value; ConvertError (not UTF-8, invalid JSON, too deep) otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConvertError(f"not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise ConvertError("invalid JSON (nested too deeply)") from None
    except ValueError as e:
        raise ConvertError(f"invalid JSON ({e})") from None
    return plain(value)


def content_id(source: str, item) -> str:
    """An id for an entry that names none: a digest of its content."""
    text = json.dumps(item, sort_keys=True, default=repr, ensure_ascii=False)
    return f"{source}-" + hashlib.sha256(text.encode()).hexdigest()[:24]
