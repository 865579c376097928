"""Speculative decoding in vLLM: the target with a draft exported for it (`specdistill export
--format vllm`), decoding token-id prompts, and vLLM's own speculation counters read into the
project's `SpecStats` (eval/round_stats.py: the same meanings, vLLM's), so that the project's
engine and the engine users deploy are compared on the same prompts, number for number.

    run = VllmSpeculation(
        target_dir, VllmSettings(), draft=export_dir, speculation={"method": "eagle3"}, gamma=3
    )
    out = run.generate(prompts, temperature=0.0, max_new_tokens=64, eos_token_id=2)
    out.stats.as_dict()["mean_acceptance_length"]    # vLLM's, over this call's rounds
    run.close()

`draft=None` decodes with the target alone (the baseline of tokens/s and of greedy output).
The counters are process-wide in vLLM (its Prometheus registry): a call's are the difference
of the totals before and after it.
"""

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specdistill.eval.round_stats import SpecStats
from specdistill.eval.vllm_engine import (
    VllmError,
    VllmSettings,
    release,
    start_llm,
    stopping,
)

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def speculative_config(draft, speculation: Mapping[str, object] | None, gamma: int) -> dict:
    """vLLM's `speculative_config` for the exported `draft` directory: the draft type's keys
    (`speculation`) over EAGLE-3 with probabilistic proposals (this project's rule)."""
    return {
        "method": "eagle3",
        "draft_sample_method": "probabilistic",
        **(speculation or {}),
        "model": str(draft),
        "num_speculative_tokens": gamma,
    }


@dataclass
class VllmRun:
    """One `generate` call: per prompt the generated ids (the stop token included), vLLM's
    speculation counters over the call (zero without a draft), its wall time."""

    sequences: list[list[int]]
    stats: SpecStats
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return sum(len(s) for s in self.sequences) / self.wall_s


def counters(metrics) -> SpecStats:
    """vLLM's speculation counters (`LLM.get_metrics()`, summed over engines) as a
    `SpecStats`."""
    stats = SpecStats()
    for metric in metrics:
        if metric.name == DRAFTS:
            stats.num_spec_steps += int(metric.value)
        elif metric.name == DRAFT_TOKENS:
            stats.num_draft_tokens += int(metric.value)
        elif metric.name == ACCEPTED:
            stats.num_accepted_draft_tokens += int(metric.value)
        elif metric.name == PER_POSITION:
            values = [int(v) for v in metric.values]
            hist = stats.acceptance_histogram
            hist += [0] * (len(values) - len(hist))
            for j, v in enumerate(values):
                hist[j] += v
    return stats


def difference(after: SpecStats, before: SpecStats) -> SpecStats:
    """The counters of what happened between two readings."""
    n = max(len(after.acceptance_histogram), len(before.acceptance_histogram))
    a = after.acceptance_histogram + [0] * (n - len(after.acceptance_histogram))
    b = before.acceptance_histogram + [0] * (n - len(before.acceptance_histogram))
    accepted = after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
    return SpecStats(
        num_spec_steps=after.num_spec_steps - before.num_spec_steps,
        num_draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
        num_accepted_draft_tokens=accepted,
        acceptance_histogram=[x - y for x, y in zip(a, b, strict=True)],
    )


class VllmSpeculation:
    """vLLM's `LLM` over the model directory `target`, with `draft` (an export's directory)
    proposing `gamma` tokens a round as `speculation` says (the draft type's
    `capabilities.vllm_speculation`: vLLM's method and its options), or alone.

    The draft samples its proposals from its own distribution at the request's temperature
    (vLLM's `draft_sample_method="probabilistic"`, the rule this project's engine follows;
    vLLM's default proposes its argmax at every temperature), unless `speculation` says
    otherwise."""

    def __init__(
        self,
        target: str,
        settings: VllmSettings,
        *,
        draft: str | None = None,
        speculation: Mapping[str, object] | None = None,
        gamma: int = 3,
    ):
        if draft is not None and gamma < 1:
            raise VllmError(f"a draft proposes at least 1 token a round, got gamma {gamma}")
        options = {}
        if draft is not None:
            options["speculative_config"] = speculative_config(draft, speculation, gamma)
        self.vllm, self.llm = start_llm(str(target), settings, log_stats=True, **options)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        temperature: float,
        max_new_tokens: int,
        eos_token_id: int | None,
    ) -> VllmRun:
        """Decode `prompts` (token id lists) to `max_new_tokens` or past `eos_token_id`."""
        params = self.vllm.SamplingParams(
            temperature=temperature,
            max_tokens=max_new_tokens,
            detokenize=False,
            **stopping(eos_token_id),
        )
        inputs = [self.vllm.TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts]
        before = counters(self.llm.get_metrics())
        start = time.perf_counter()
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - start
        stats = difference(counters(self.llm.get_metrics()), before)
        sequences = [list(out.outputs[0].token_ids) for out in outputs]
        return VllmRun(sequences, stats, wall)

    def close(self) -> None:
        """Let vLLM's engine go; the object is unusable after."""
        release(self)
