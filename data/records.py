"""Records: what a source yields before tokenisation, and the checks that make one.

A record is either a document (`TextRecord`) or a conversation (`ChatRecord`). A row from
JSONL, a JSON list, parquet or a Hub dataset becomes one through `record_from_row`, which
accepts three shapes:

    {"text": "..."}                                             a document
    {"messages": [{"role": "user", "content": "..."}, ...]}     OpenAI chat
    {"conversations": [{"from": "human", "value": "..."}, ...]} ShareGPT chat

A conversation whose last turn is the answer a model generated may carry the token ids it was
generated as (what `specdistill prepare` writes), so that training reads the tokens the model
drew rather than a re-tokenization of their text:

    {"messages": [...], "token_ids": {"prompt": [ids], "answer": [ids]}}

`origin` says where a record came from (`path`, `path:line`, `org/name:train[i]`) so that
every later error can point at it.
"""

import re
from dataclasses import dataclass
from typing import Any

from specdistill.errors import UserError

# What a DataError is about, in short stable words, for counting skipped records: the first
# phrase found in its message (written here, in sources.py or in tokenize.py) gives it.
REASONS = (
    ("malformed JSON", "invalid JSON"),
    ("not UTF-8", "not UTF-8"),
    ("expected a JSON object", "not a JSON object"),
    ("must hold a list of records", "not a list of records"),
    ("expected 'text', 'messages' or 'conversations'", "no text or messages"),
    ("'text' must be a string", "text not a string"),
    ("unknown role", "unknown role"),
    ("starts with an assistant message", "starts with assistant"),
    ("not prefix-stable", "template not prefix-stable"),
    ("chat template failed", "template error"),
    ("'token_ids'", "bad token ids"),
)
OTHER_REASON = "malformed record"  # e.g. a turn without 'content', content not text


class DataError(UserError):
    """A problem with the data. The message names where (file:line or record) and what."""

    @property
    def reason(self) -> str:
        """The kind of problem, one of REASONS' or OTHER_REASON, for counting skipped records."""
        message = str(self)
        return next((reason for phrase, reason in REASONS if phrase in message), OTHER_REASON)


@dataclass
class TextRecord:
    text: str
    origin: str


@dataclass(frozen=True)
class TokenIds:
    """A generated answer's token ids: the prompt as encoded (chat template and generation
    prompt included) and the tokens drawn, its end-of-turn token included."""

    prompt: tuple[int, ...]
    answer: tuple[int, ...]


@dataclass
class ChatRecord:
    messages: list[dict[str, str]]  # [{"role": system|user|assistant, "content": str}, ...]
    origin: str
    token_ids: TokenIds | None = None  # the last (assistant) turn as generated


Record = TextRecord | ChatRecord

ROLES = ("system", "user", "assistant")
# A lone UTF-16 surrogate: JSON's "\ud800" escape without its pair. `json.loads` joins a valid
# pair into one character, so any surrogate in a parsed string is lone: not text UTF-8 holds.
SURROGATE = re.compile("[\ud800-\udfff]")
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}


def record_from_row(row: Any, origin: str) -> Record | None:
    """The record in `row`, or None for an empty document (nothing to learn, not an error).

    Raises DataError naming `origin` if the row is malformed. A field whose value is None
    counts as absent (tabular sources have every column in every row).
    """
    if not isinstance(row, dict):
        raise DataError(f"{origin}: expected a JSON object, got {_type_name(row)}")
    if row.get("messages") is not None:
        messages = _openai_messages(row["messages"], origin)
        ids = _token_ids(row.get("token_ids"), messages, origin)
        return _text_only(ChatRecord(messages, origin, ids))
    if row.get("conversations") is not None:
        return _text_only(ChatRecord(_sharegpt_messages(row["conversations"], origin), origin))
    if row.get("text") is not None:
        text = row["text"]
        if not isinstance(text, str):
            raise DataError(f"{origin}: 'text' must be a string, got {_type_name(text)}")
        return _text_only(TextRecord(text, origin)) if text else None
    raise DataError(
        f"{origin}: missing field: expected 'text', 'messages' or 'conversations' "
        f"(keys: {', '.join(map(str, row)) or 'none'})"
    )


MAX_TOKEN_ID = 2**31 - 1  # token ids are stored as int32
MAX_IDS = 1 << 20  # per prompt or answer: far beyond any context a record can train on


def _token_ids(value: Any, messages: list[dict[str, str]], origin: str) -> TokenIds | None:
    """A row's 'token_ids' (None when absent): {"prompt": [int], "answer": [int]}, non-empty
    lists of token ids, on a conversation that ends with the answer they encode."""
    if value is None:
        return None
    where = f"{origin}: 'token_ids'"
    if not isinstance(value, dict) or set(value) != {"prompt", "answer"}:
        raise DataError(f"{where} must be an object with 'prompt' and 'answer' lists of ids")
    if messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: the conversation must end with the answer the ids encode")
    parts = []
    for key in ("prompt", "answer"):
        ids = value[key]
        ok = isinstance(ids, list) and 0 < len(ids) <= MAX_IDS
        if not ok or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in ids):
            raise DataError(
                f"{where}['{key}'] must be a list of 1 to {MAX_IDS} token ids "
                f"(integers in [0, {MAX_TOKEN_ID}])"
            )
        parts.append(tuple(ids))
    return TokenIds(*parts)


def lone_surrogate(value: str) -> int | None:
    """The offset of the first lone surrogate in `value` (`SURROGATE`), or None."""
    found = SURROGATE.search(value)
    return found.start() if found else None


def _text_only(record: Record) -> Record:
    """`record`, unless a string of it holds a lone surrogate: no tokenizer or UTF-8 file
    takes it (DataError, counted as "not UTF-8")."""
    chat = isinstance(record, ChatRecord)
    strings = [m["content"] for m in record.messages] if chat else [record.text]
    if any(lone_surrogate(s) is not None for s in strings):
        raise DataError(f"{record.origin}: not UTF-8 text (it holds a lone surrogate)")
    return record


def _openai_messages(messages: Any, origin: str) -> list[dict[str, str]]:
    return _turns(messages, "messages", ("role", "content"), {r: r for r in ROLES}, origin)


def _sharegpt_messages(turns: Any, origin: str) -> list[dict[str, str]]:
    return _turns(turns, "conversations", ("from", "value"), SHAREGPT_ROLES, origin)


def _turns(
    turns: Any, field: str, keys: tuple[str, str], roles: dict[str, str], origin: str
) -> list[dict[str, str]]:
    """Chat turns -> [{"role", "content"}]: `keys` = (role key, text key) of this format,
    `roles` maps its role names onto system / user / assistant."""
    _check_turn_list(turns, field, origin)
    role_key, text_key = keys
    out = []
    for i, turn in enumerate(turns):
        where = f"{origin}: {field}[{i}]"
        if not isinstance(turn, dict):
            raise DataError(f"{where} must be an object, got {_type_name(turn)}")
        for key in keys:
            if key not in turn:
                raise DataError(f"{where}: missing field '{key}'")
        role = turn[role_key]
        if role not in roles:
            in_key = "" if role_key == "role" else f" in '{role_key}'"
            raise DataError(
                f"{where}: unknown role {role!r}{in_key} (expected one of {', '.join(roles)})"
            )
        out.append({"role": roles[role], "content": _content(turn[text_key], where, text_key)})
    return out


def _check_turn_list(turns: Any, field: str, origin: str) -> None:
    if not isinstance(turns, list):
        raise DataError(f"{origin}: '{field}' must be a list, got {_type_name(turns)}")
    if not turns:
        raise DataError(f"{origin}: '{field}' is an empty list")


def _content(content: Any, where: str, key: str = "content") -> str:
    """A message's text: a string, or OpenAI content parts [{"type": "text", "text": ...}]."""
    if isinstance(content, str):
        return content
    if key != "content":  # ShareGPT 'value': a string only
        raise DataError(f"{where}: '{key}' must be a string, got {_type_name(content)}")
    if not isinstance(content, list):
        raise DataError(
            f"{where}: 'content' must be a string or a list of text parts, "
            f"got {_type_name(content)}"
        )
    if not content:
        raise DataError(f"{where}: 'content' is an empty list")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text"):
            kind = part.get("type") if isinstance(part, dict) else _type_name(part)
            raise DataError(f"{where}: content[{j}] is not a text part (type {kind!r})")
        if not isinstance(part.get("text"), str):
            raise DataError(f"{where}: content[{j}]['text'] must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def utf8_text(raw: bytes, path, error: type[Exception], what: str) -> str:
    """`raw` decoded as UTF-8; else `error` naming `path` (and the line), UTF-16 as such, and
    what to do: save `what` as UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
            raise error(f"{path}: UTF-16 text; save {what} as UTF-8") from None
        line = raw[: e.start].count(b"\n") + 1
        raise error(
            f"{path}:{line}: not UTF-8 ({e.reason} at byte {e.start}); save {what} as UTF-8"
        ) from None
