"""vLLM's speculation counters read into the project's `SpecStats` (eval/vllm_speculate.py),
without vLLM: the metric names and the vector of accepted tokens per position, summed over
engines, and a call's counters as the difference of two readings."""

from dataclasses import dataclass

from specdistill.eval import vllm_speculate as vs


@dataclass
class Counter:
    name: str
    value: int


@dataclass
class Vector:
    name: str
    values: list[int]


def reading(drafts, tokens, accepted, per_position, engines=1):
    one = [
        Counter(vs.DRAFTS, drafts),
        Counter(vs.DRAFT_TOKENS, tokens),
        Counter(vs.ACCEPTED, accepted),
        Vector(vs.PER_POSITION, per_position),
        Counter("vllm:prompt_tokens", 999),  # not a speculation counter
    ]
    return one * engines


def test_counters_sum_engines_and_a_call_is_a_difference():
    before = vs.counters(reading(10, 30, 12, [8, 3, 1], engines=2))
    assert before.num_spec_steps == 20 and before.acceptance_histogram == [16, 6, 2]
    after = vs.counters(reading(25, 75, 30, [18, 9, 3], engines=2))
    call = vs.difference(after, before).as_dict()
    assert call["num_spec_steps"] == 30 and call["num_draft_tokens"] == 90
    assert call["acceptance_histogram"] == [20, 12, 4]
    assert call["mean_acceptance_length"] == 1 + 36 / 30


def test_no_speculation_reads_as_zero_rounds():
    call = vs.difference(vs.counters([]), vs.counters([]))
    assert call.as_dict()["num_spec_steps"] == 0 and call.as_dict()["mean_acceptance_length"] == 1.0
