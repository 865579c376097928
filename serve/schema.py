"""Requests: the body read within limits, validated by pydantic models, then tokenised.

The limits (`Limits`) come from the server's options (serve/options.py). Order of the checks,
cheapest first, so that no request costs more than its limits allow:

1. body size (`Limits.max_body_bytes`), 413, and the time it takes to arrive, 408, while it
   is read (serve/intake.py), before the request takes an admission slot;
2. JSON nesting depth (`Limits.max_json_depth`), counted on the raw bytes before parsing, 400;
3. JSON parsing and the pydantic model (`CompletionRequest`, `ChatCompletionRequest`):
   every field typed and range-checked, NaN and Infinity refused, booleans only as JSON
   `true` / `false`, unknown fields refused (400 naming the field), a lone UTF-16 surrogate
   (`"\\ud800"`) in any string refused (400 naming the field: no such string can be encoded,
   tokenised or logged), OpenAI fields this server does not implement refused when set to
   anything but their neutral value (`UNSUPPORTED`);
4. the number of messages, stop strings and the prompt's length in characters, 400;
5. tokenising (the prompt is at most `max_prompt_chars` characters by then), then the
   context check: prompt tokens + max_tokens above `max_model_len` is a 400 naming both
   numbers; a request without max_tokens gets min(the default, the room left).

A temperature below `GREEDY_BELOW` (1e-5, eval/sampling.py) is greedy decoding, as vLLM and
SGLang decode a temperature near 0 greedily rather than divide logits by it (a subnormal one
overflows them); the traffic record names the temperature served, 0.
"""

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdistill.data.records import lone_surrogate
from specdistill.eval.engine import Sampling
from specdistill.eval.sampling import GREEDY_BELOW
from specdistill.serve.errors import APIError
from specdistill.serve.options import MAX_TOP_LOGPROBS, Limits

# ----------------------------------------------------------------------------- the models

Int = Annotated[int, Field(strict=True)]
Float = Annotated[float, Field(strict=True)]  # ints are accepted, bools and strings are not
Bool = Annotated[bool, Field(strict=True)]  # JSON true / false only: not "yes", 1 or "true"
SEED_RANGE = dict(ge=-(2**63), le=2**64 - 1)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: Bool | None = None
    continuous_usage_stats: Bool | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Annotated[str, Field(min_length=1, max_length=64)]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _Common(_Strict):
    model: str | None = None
    max_tokens: Annotated[Int, Field(ge=1)] | None = None
    temperature: Annotated[Float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[Int, Field(ge=1)] | None = None
    stream: Bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[Int, Field(**SEED_RANGE)] | None = None
    presence_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[str, Float] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    category: str | None = None  # this server's: the traffic record's category
    store: Bool | None = None
    service_tier: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[Int]
    logprobs: Annotated[Int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    best_of: Annotated[Int, Field(ge=1)] | None = None
    echo: Bool | None = None
    suffix: str | None = None


class ChatCompletionRequest(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    logprobs: Bool | None = None
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: Bool | None = None


def _unsupported(req: _Common) -> str | None:
    """The first OpenAI field set to something this server does not implement."""
    checks = [
        ("n", req.n not in (None, 1), "only n=1 is supported"),
        ("presence_penalty", bool(req.presence_penalty), "only 0 is supported"),
        ("frequency_penalty", bool(req.frequency_penalty), "only 0 is supported"),
        ("logit_bias", bool(req.logit_bias), "is not supported"),
    ]
    if isinstance(req, CompletionRequest):
        checks += [
            ("best_of", req.best_of not in (None, 1), "is not supported"),
            ("echo", bool(req.echo), "is not supported"),
            ("suffix", bool(req.suffix), "is not supported"),
        ]
    else:
        fmt = req.response_format
        checks += [
            (
                "response_format",
                fmt is not None and fmt.get("type", "text") != "text",
                "only {'type': 'text'} is supported",
            ),
            ("tools", bool(req.tools), "tool calling is not supported"),
            ("tool_choice", req.tool_choice not in (None, "none"), "is not supported"),
            ("functions", bool(req.functions), "function calling is not supported"),
            ("function_call", req.function_call not in (None, "none"), "is not supported"),
        ]
    for field, bad, why in checks:
        if bad:
            raise APIError(400, f"{field}: {why} by this server", param=field)
    return None


# ----------------------------------------------------------------------------- the body


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """Whether the JSON text nests arrays/objects deeper than `limit` (strings skipped)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    depth = 0
    for c in _STRING.sub(b"", body).translate(None, _NOT_BRACKET):
        depth += 1 if c in (0x5B, 0x7B) else -1
        if depth > limit:
            return True
    return False


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how JSON text spells a surrogate


def lone_surrogate_at(data: object) -> str | None:
    """The path (`messages.0.content`) of a string in parsed JSON that holds a lone surrogate
    (of the object, for a key that holds one); None if there is none. `json.loads` joins a
    valid pair into one character, so any surrogate left is lone. The depth is bounded by
    `json_depth_exceeds`, which runs first."""
    todo: list[tuple[str, object]] = [("", data)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            if lone_surrogate(value) is not None:
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                inner = f"{path}.{key}" if path else key
                if lone_surrogate(key) is not None:
                    return path or "body"
                todo.append((inner, item))
        elif isinstance(value, list):
            todo += [(f"{path}.{i}" if path else str(i), item) for i, item in enumerate(value)]
    return None


def validate_body(body: bytes, chat: bool, limits: Limits) -> _Common:
    if json_depth_exceeds(body, limits.max_json_depth):
        raise APIError(400, f"the JSON body nests deeper than {limits.max_json_depth} levels")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(body):
        where = lone_surrogate_at(data)
        if where is not None:
            raise APIError(
                400, f"{where}: a string holds a lone UTF-16 surrogate (not text)", param=where
            )
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False)[0]
        param = ".".join(str(p) for p in first["loc"])
        message = first["msg"]
        if first["type"] == "extra_forbidden":
            message = "is not a field this server accepts"
        if e.error_count() > 1:
            message += f" (and {e.error_count() - 1} more errors)"
        raise APIError(400, f"{param}: {message}", param=param) from None
    _unsupported(req)
    return req


# ----------------------------------------------------------------------------- parsed


@dataclass
class Parsed:
    chat: bool
    prompt_ids: list[int]
    prompt: object  # text or messages, for the traffic record
    max_tokens: int
    sampling: Sampling
    stops: list[str]
    logprobs: int | None  # top-k the client asked for (None: no logprobs)
    stream: bool
    include_usage: bool
    category: str | None
    seed: int | None


def check_sizes(req: _Common, limits: Limits) -> None:
    """Counts and lengths, before anything is tokenised."""
    if isinstance(req, ChatCompletionRequest):
        if len(req.messages) > limits.max_messages:
            raise APIError(
                400,
                f"messages: {len(req.messages)} messages, more than this server accepts "
                f"({limits.max_messages})",
                param="messages",
            )
        chars, param = sum(len(m.text()) for m in req.messages), "messages"
    elif isinstance(req.prompt, str):
        chars, param = len(req.prompt), "prompt"
    elif req.prompt and all(isinstance(p, str) for p in req.prompt):
        chars, param = sum(len(p) for p in req.prompt), "prompt"
    else:
        chars, param = 0, "prompt"
        if len(req.prompt) > limits.max_model_len:
            raise APIError(400, _context(limits, len(req.prompt), None, chat=False), param=param)
    if chars > limits.max_prompt_chars:
        raise APIError(
            400,
            f"{param}: the prompt has {chars} characters, more than this server accepts "
            f"({limits.max_prompt_chars})",
            param=param,
        )
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stops) > limits.max_stops or any(len(s) > limits.max_stop_chars for s in stops):
        raise APIError(
            400,
            f"stop: at most {limits.max_stops} stop strings of at most "
            f"{limits.max_stop_chars} characters each",
            param="stop",
        )


def _context(limits: Limits, n_prompt: int, n_out: int | None, chat: bool) -> str:
    where = "messages" if chat else "prompt"
    head = f"This model's maximum context length is {limits.max_model_len} tokens. However, "
    if n_out is None:
        return head + f"your {where} has {n_prompt} tokens. Please reduce its length."
    return head + (
        f"you requested {n_prompt + n_out} tokens ({n_prompt} in the {where}, {n_out} in the "
        f"completion). Please reduce the length of the {where} or completion."
    )


def parse(req: _Common, tokenizer, limits: Limits) -> Parsed:
    """Tokenise a validated request and fit it into the context (APIError otherwise)."""
    chat = isinstance(req, ChatCompletionRequest)
    check_sizes(req, limits)
    if chat:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompt: object = messages
    else:
        prompt = req.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = tokenizer(prompt)["input_ids"]
        elif prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
            if max(prompt_ids) >= len(tokenizer) or min(prompt_ids) < 0:
                raise APIError(400, "prompt token ids out of the vocabulary", param="prompt")
            prompt = tokenizer.decode(prompt_ids)
        else:
            raise APIError(
                400, "prompt must be a string, or a list of token ids (one prompt)", param="prompt"
            )
    if not prompt_ids:
        raise APIError(400, "the prompt encodes to no tokens", param="prompt")
    n_prompt = len(prompt_ids)
    param = "messages" if chat else "prompt"
    room = limits.max_model_len - n_prompt
    if room < 1:
        raise APIError(400, _context(limits, n_prompt, None, chat), param=param)
    key = "max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens"
    asked = req.max_completion_tokens if key == "max_completion_tokens" else req.max_tokens
    if asked is None:
        max_tokens = min(limits.default_max_tokens, room)
    elif asked > room:
        raise APIError(400, _context(limits, n_prompt, asked, chat), param=key)
    else:
        max_tokens = asked
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    if temperature < GREEDY_BELOW:
        temperature = 0.0
    top_p = 1.0 if req.top_p is None else float(req.top_p)
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if chat:
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = top if req.logprobs else None
    else:
        logprobs = req.logprobs
    category = (req.metadata or {}).get("category")
    category = category if category is not None else req.category
    return Parsed(
        chat=chat,
        prompt_ids=prompt_ids,
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=Sampling(temperature, None if top_p >= 1.0 else top_p, None, req.seed),
        stops=stops,
        logprobs=logprobs,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        category=None if category is None else str(category),
        seed=req.seed,
    )
