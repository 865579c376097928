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


@dataclass
class Prompt:
    id: str
    text: str | None = None
    messages: list[dict] | None = None


def _record_prompt(record: dict, index: int) -> Prompt:
    rid = str(record.get("question_id", record.get("task_id", record.get("id", index))))
    if "messages" in record:
        return Prompt(rid, messages=record["messages"])
    if "turns" in record:
        return Prompt(rid, messages=[{"role": "user", "content": record["turns"][0]}])
    for key in ("prompt", "text"):
        if key in record:
            return Prompt(rid, text=record[key])
    raise ValueError(
        f"prompt record {index} has none of the fields messages / turns / prompt / text "
        f"(keys: {sorted(record)})"
    )


def load_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """Read prompts from `path` (formats in the module docstring); the first `limit` if given."""
    path = Path(path)
    suffixes = path.suffixes
    opener = gzip.open if suffixes and suffixes[-1] == ".gz" else open
    kind = suffixes[-2] if suffixes[-1:] == [".gz"] and len(suffixes) > 1 else path.suffix
    if kind not in (".txt", ".jsonl", ".json"):
        raise ValueError(
            f"unknown prompt file type '{kind}' for {path}: use .txt, .jsonl or .json (or .gz)"
        )
    with opener(path, "rt", encoding="utf-8") as f:
        content = f.read()
    if kind == ".txt":
        prompts = [
            Prompt(str(i), text=line) for i, line in enumerate(content.splitlines()) if line.strip()
        ]
    elif kind == ".jsonl":
        records = [json.loads(line) for line in content.splitlines() if line.strip()]
        prompts = [_record_prompt(r, i) for i, r in enumerate(records)]
    else:
        prompts = [_record_prompt(r, i) for i, r in enumerate(json.loads(content))]
    if not prompts:
        raise ValueError(f"no prompts in {path}")
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
        encoded.append(ids[-max_tokens:] if max_tokens else ids)
    return encoded
