"""Synthetic traffic (docs/traffic.md schema), online recipes, a quiet online job and the
lines of a JSON-lines file, for the online job's tests."""

import json
from pathlib import Path

CODE = ["def f{i}(a, b):", "class C{i}:\n    def", "for i in range({i}):", "import os  # {i}\n"]
PROSE = ["The topic {i} describes", "Help on section {i}: the", "Operator precedence {i} is"]


def make_record(
    i, prompt, prompt_ids, completion_ids, text, identity, *, category, t=0.0, name="tiny", rate=0.5
):
    drafted = 6
    return {
        "schema_version": 1,
        "id": f"cmpl-{i:05d}",
        "time": 1_000_000.0 + i,
        "endpoint": "completions",
        "target": {"name": name, "identity": identity},
        "draft_version": "v000001",
        "sampling": {"temperature": t, "top_p": 1.0, "max_tokens": 8, "seed": None, "stop": []},
        "prompt": prompt,
        "prompt_token_ids": prompt_ids,
        "completion_token_ids": completion_ids,
        "completion_text": text,
        "finish_reason": "length",
        "speculative": {
            "mean_acceptance_length": 1 + rate * 3,
            "draft_acceptance_rate": rate,
            "acceptance_histogram": [1, 1, 1],
            "num_spec_steps": 2,
            "num_draft_tokens": drafted,
            "num_accepted_draft_tokens": round(rate * drafted),
        },
        "category": category,
        "top_logprobs": None,
        "latency_s": 0.01,
        "ttft_s": 0.001,
    }


def kept(record: dict, top_logprobs: bool = False):
    """What the online store keeps of a traffic record given as its JSON object."""
    from specdistill.formats.traffic import TrafficRecord
    from specdistill.train.online.kept import KeptRecord

    return KeptRecord.of(TrafficRecord.model_validate(record), top_logprobs)


def write_shard(directory: Path, index: int, records: list, extra_lines: list[bytes] = ()):
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"traffic-{index:06d}.jsonl", "ab") as f:
        for r in records:
            f.write((json.dumps(r) + "\n").encode())
        for line in extra_lines:
            f.write(line)


def online_recipe(tiny_pair, tmp: Path, **online):
    from specdistill.train.config import load_recipe

    target, draft, _ = tiny_pair
    overrides = {
        "target.model": str(target),
        "draft.model": str(draft),
        "data.max_length": 64,
        "loss.name": "fkl",
        "train.global_batch_size": 8,
        "train.micro_batch_size": 8,
        "train.lr": 0.01,
        "online.traffic": str(tmp / "traffic"),
        "online.drafts": str(tmp / "drafts"),
        "online.output_dir": str(tmp / "out"),
        "online.follow": False,
        "online.refresh_records": 24,
        "online.refresh_steps": 3,
        "online.holdout_size": 12,
        "online.min_holdout": 4,
        "online.recent_size": 48,
        "online.reservoir_size": 16,
        "online.bootstrap_samples": 200,
        "online.min_category_samples": 4,
        "online.watch_window": 10,
        **{f"online.{k}": v for k, v in online.items()},
    }
    return load_recipe(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


def quiet(*args, **kwargs):
    pass


def job(recipe, faults=None):
    from specdistill.train.online.job import OnlineJob

    return OnlineJob(recipe, print=quiet, **({"faults": faults} if faults else {}))


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
