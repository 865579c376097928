"""`regenerate`'s prompts: one `Job` per distinct prompt of the data (a chat record's messages
up to its last non-assistant one, a text record's first tokens), its hash, its encoding with
the chat template, and the shard line its answer becomes."""

import hashlib
import json
from dataclasses import dataclass


@dataclass
class Job:
    """One prompt: `prompt` is the chat messages (a list) or the text prefix (a str)."""

    hash: str
    prompt: list | str
    origin: str


def prompt_hash(prompt: list | str) -> str:
    return hashlib.sha256(
        json.dumps(prompt, sort_keys=True, ensure_ascii=False).encode()
    ).hexdigest()


def jobs_from_records(records, tokenizer, text_prompt_tokens: int) -> tuple[list[Job], int]:
    """(one Job per distinct prompt, in data order; duplicates dropped)."""
    from specdistill.data.records import ChatRecord  # lazy: --help loads no torch

    jobs, seen, duplicates = [], set(), 0
    for record in records:
        if isinstance(record, ChatRecord):
            messages = record.messages
            last = max((i for i, m in enumerate(messages) if m["role"] != "assistant"), default=-1)
            if last < 0:
                continue  # nothing to answer
            prompt = [dict(m) for m in messages[: last + 1]]
        else:
            ids = tokenizer(record.text, add_special_tokens=False)["input_ids"]
            if len(ids) <= 1:
                continue
            prompt = tokenizer.decode(ids[:text_prompt_tokens])
        h = prompt_hash(prompt)
        if h in seen:
            duplicates += 1
            continue
        seen.add(h)
        jobs.append(Job(h, prompt, record.origin))
    return jobs, duplicates


def record(job: Job, answer: str, n_tokens: int, token_ids: dict) -> dict:
    """The shard line of `job`'s answer; a chat answer carries the `token_ids` it was
    generated as (data/records.py)."""
    if isinstance(job.prompt, list):
        messages = [*job.prompt, {"role": "assistant", "content": answer}]
        body = {"messages": messages, "token_ids": token_ids}
    else:
        body = {"text": job.prompt + answer}
    return {**body, "prompt_hash": job.hash, "origin": job.origin, "completion_tokens": n_tokens}


def encode(jobs: list[Job], tokenizer) -> list[list[int]]:
    from specdistill.eval.prompts import Prompt, encode_prompts  # lazy: --help loads no torch

    prompts = [
        Prompt(j.hash, messages=j.prompt)
        if isinstance(j.prompt, list)
        else Prompt(j.hash, text=j.prompt)
        for j in jobs
    ]
    return encode_prompts(prompts, tokenizer)
