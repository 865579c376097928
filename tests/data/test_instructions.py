"""The prompt pool made from the standard library (data/instructions.py): large enough for the
real-model recipes and the data-scaling table, each request once, its held-out requests never
among the training ones, and no evaluation prompt (HumanEval, Spec-Bench) in it."""

import gzip
import json
from pathlib import Path

from specdistill.data.instructions import stdlib_instructions

PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"


def _benchmark_prompts() -> list[str]:
    with gzip.open(PROMPTS / "HumanEval.jsonl.gz", "rt") as f:
        humaneval = [json.loads(line)["prompt"] for line in f]
    spec_bench = []
    for line in (PROMPTS / "spec_bench_questions.jsonl").read_text().splitlines():
        spec_bench += json.loads(line)["turns"]
    return humaneval + spec_bench


def test_the_pool_has_over_7500_distinct_training_requests_and_a_disjoint_held_out_set():
    """Enough for the 8,000-answer point of the data-scaling table (benchmarks/RESULTS.md)."""
    train, heldout = stdlib_instructions("train"), stdlib_instructions("heldout")
    assert len(train) == len(set(train)) >= 7500
    assert len(heldout) == len(set(heldout)) >= 300
    assert not set(train) & set(heldout)


def test_no_evaluation_prompt_is_a_training_request():
    pool = stdlib_instructions("train") + stdlib_instructions("heldout")
    for prompt in _benchmark_prompts():
        probe = prompt.strip()[:120]
        assert not any(probe in request for request in pool), probe
