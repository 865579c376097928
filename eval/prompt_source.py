"""Prompt token ids from a source outside the training data (the recipe's `eval.prompts`):
a prompt file in the formats of eval/prompts.py (JSONL, JSONL.gz, JSON, TXT: e.g.
benchmarks/prompts/HumanEval.jsonl.gz), or a traffic directory (docs/traffic.md: each
record's `prompt_token_ids`, in the order the shards hold them)."""

from pathlib import Path

from specdistill.errors import UserError
from specdistill.eval.prompts import encode_prompts, load_prompts
from specdistill.formats.traffic_shards import read_records


def source_prompt_ids(source: str, tokenizer, *, limit: int, max_tokens: int) -> list[list[int]]:
    """The first `limit` prompts of `source` as token ids, each cut to its last `max_tokens`
    tokens; a UserError naming the source when it holds none or does not exist."""
    path = Path(source)
    if path.is_dir():
        ids = [list(r.prompt_token_ids)[-max_tokens:] for r in read_records(path)[:limit]]
        ids = [p for p in ids if p]
        if not ids:
            raise UserError(f"eval.prompts {source}: no traffic records with prompt tokens")
        return ids
    if not path.is_file():
        raise UserError(
            f"eval.prompts {source}: no such file or directory (a prompt file, e.g. "
            "benchmarks/prompts/HumanEval.jsonl.gz, or a traffic directory)"
        )
    return encode_prompts(load_prompts(path, limit), tokenizer, max_tokens)
