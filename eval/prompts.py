"""Evaluation prompts from files: plain text, JSONL records, chat messages, Spec-Bench, HumanEval.

Formats (by extension; `.gz` is decompressed first):
- `.txt`: one prompt per non-empty line (use JSONL for multi-line prompts).
- `.jsonl`, one record per line, or `.json`, a list of records. Each record gives its prompt by
  the first present of: `messages` (chat: [{"role", "content"}]), `turns` (Spec-Bench / MT-bench:
  the first turn becomes one user message; later turns need the model's own answers, so they
  are not used), `prompt` (raw text, e.g. HumanEval), `text` (raw text).
  Its id is `question_id`, `task_id` or `id`, else the record's index.

Chat prompts go through the tokenizer's chat template with the generation prompt added; a
tokenizer without a template gets "role: content" lines followed by "assistant:".
"""

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from specdistill.data.records import lone_surrogate, utf8_text
from specdistill.errors import UserError


@dataclass
class Prompt:
    id: str
    text: str | None = None
    messages: list[dict] | None = None
    category: str | None = None  # the record's `category` (Spec-Bench), for per-category reports


class PromptError(UserError):
    """A prompt file that cannot be read; the message names the file (and line) at fault."""


_FIELDS = "messages / turns / prompt / text"
_TOO_DEEP = "JSON nested too deeply to read (lists or objects inside each other)"


def _record_prompt(record, index: int, where: str) -> Prompt:
    """The prompt of one record; `index` gives the fallback id, `where` locates it in errors."""
    if not isinstance(record, dict):
        raise PromptError(f"{where}: expected a JSON object, got {type(record).__name__}")
    rid = _unicode(
        str(record.get("question_id", record.get("task_id", record.get("id", index)))), where, "id"
    )
    category = record.get("category")
    category = None if category is None else _unicode(str(category), where, "category")
    if "messages" in record:
        return Prompt(rid, messages=_messages(record["messages"], where), category=category)
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise PromptError(f"{where}: 'turns' must be a non-empty list")
        first = _string(turns[0], where, "turns[0]")
        return Prompt(rid, messages=[{"role": "user", "content": first}], category=category)
    for key in ("prompt", "text"):
        if key in record:
            text = _string(record[key], where, key)
            if not text:
                raise PromptError(f"{where}: '{key}' is empty")
            return Prompt(rid, text=text, category=category)
    raise PromptError(f"{where}: record has none of the fields {_FIELDS} (keys: {sorted(record)})")


def _string(value, where: str, field: str) -> str:
    if not isinstance(value, str):
        got = "null" if value is None else type(value).__name__
        raise PromptError(f"{where}: '{field}' must be a string, got {got}")
    return _unicode(value, where, field)


def _unicode(value: str, where: str, field: str) -> str:
    """`value` if it is text UTF-8 can hold; a lone surrogate (JSON's "\\ud800" escape without
    its pair) is a PromptError naming the field and the character's offset."""
    at = lone_surrogate(value)
    if at is not None:
        raise PromptError(
            f"{where}: '{field}' holds a lone surrogate U+{ord(value[at]):04X} at "
            f"character {at}, which is not text"
        )
    return value


def _messages(messages, where: str) -> list[dict]:
    """Chat messages: a non-empty list of {"role": str, "content": str}."""
    if not isinstance(messages, list) or not messages:
        raise PromptError(f"{where}: 'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise PromptError(f"{where}: messages[{i}] must be an object")
        for key in ("role", "content"):
            _string(message.get(key), where, f"messages[{i}].{key}")
    return messages


def _read_text(path: Path, opener) -> str:
    """The file's text; PromptError naming the file and line if it is not UTF-8 (a UTF-16
    file named as such), holds a NUL byte (binary) or is not the gzip file its name says."""
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError; truncated: EOFError
        if opener is open and isinstance(e, OSError):
            raise
        raise PromptError(f"{path}: not a readable gzip file ({e})") from None
    text = utf8_text(raw, path, PromptError, "it")
    if "\0" in text:  # valid UTF-8, but no text: a NUL-filled or binary file
        line = text[: text.index("\0")].count("\n") + 1
        raise PromptError(
            f"{path}:{line}: a NUL byte: a binary file, not prompts; give a text file of "
            "prompts (.txt lines, .jsonl or .json records)"
        )
    return text.replace("\r\n", "\n").replace("\r", "\n")  # as text mode reads it


def _jsonl_prompts(content: str, path: Path) -> list[Prompt]:
    """One record per non-blank line; errors name `path:line` (1-based, blank lines counted)."""
    prompts = []
    # Text-mode reading already turned \r\n into \n; splitlines() would also split at
    # characters such as U+2028 that JSON strings may hold unescaped.
    for number, line in enumerate(content.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
        except RecursionError:
            raise PromptError(f"{where}: {_TOO_DEEP}") from None
        prompts.append(_record_prompt(record, len(prompts), where))
    return prompts


def _json_prompts(content: str, path: Path) -> list[Prompt]:
    """A list of records; errors name `path:line` for bad JSON, `path: record i` otherwise."""
    try:
        records = json.loads(content)
    except json.JSONDecodeError as e:
        raise PromptError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:
        raise PromptError(f"{path}: {_TOO_DEEP}") from None
    if not isinstance(records, list):
        raise PromptError(f"{path}: expected a JSON list of records, got {type(records).__name__}")
    return [_record_prompt(r, i, f"{path}: record {i}") for i, r in enumerate(records)]


def load_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """Read prompts from `path` (formats in the module docstring); the first `limit` if given.

    A malformed file raises `PromptError` (a `ValueError`) naming the file and line.
    """
    path = Path(path)
    suffixes = path.suffixes
    opener = gzip.open if suffixes and suffixes[-1] == ".gz" else open
    kind = suffixes[-2] if suffixes[-1:] == [".gz"] and len(suffixes) > 1 else path.suffix
    if kind not in (".txt", ".jsonl", ".json"):
        raise PromptError(
            f"unknown prompt file type '{kind}' for {path}: use .txt, .jsonl or .json (or .gz)"
        )
    content = _read_text(path, opener)
    if kind == ".txt":
        prompts = [
            Prompt(str(i), text=line) for i, line in enumerate(content.splitlines()) if line.strip()
        ]
    elif kind == ".jsonl":
        prompts = _jsonl_prompts(content, path)
    else:
        prompts = _json_prompts(content, path)
    if not prompts:
        raise PromptError(f"no prompts in {path}")
    return prompts[:limit] if limit else prompts


def prompt_text(prompt: Prompt, tokenizer) -> str:
    """The string the model is conditioned on (chat template applied to chat prompts)."""
    if prompt.messages is None:
        return prompt.text
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(
            prompt.messages, tokenize=False, add_generation_prompt=True
        )
    lines = [f"{m['role']}: {m['content']}" for m in prompt.messages]
    return "\n".join([*lines, "assistant:"])


def encode_prompts(
    prompts: list[Prompt], tokenizer, max_tokens: int | None = None
) -> list[list[int]]:
    """Token ids per prompt, keeping the last `max_tokens` of long prompts."""
    encoded = []
    for prompt in prompts:
        text = prompt_text(prompt, tokenizer)
        # A chat template already contains the special tokens it needs.
        ids = tokenizer(
            text, add_special_tokens=prompt.messages is None or not tokenizer.chat_template
        )
        ids = ids["input_ids"]
        if not ids:
            raise PromptError(f"prompt {prompt.id}: the tokenizer makes no tokens of it")
        encoded.append(ids[-max_tokens:] if max_tokens else ids)
    return encoded
