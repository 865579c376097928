"""Run in a subprocess by tests/eval/test_vllm_speculate.py (vLLM runs in its process and binds
its threads): the same prompts decoded greedily by the project's engine and by vLLM, each with
the exported EAGLE-3 head and without it.

    python -m tests.eval.vllm_spec_pair TARGET_DIR HEAD_DIR EXPORT_DIR PROMPTS_JSON

prints one JSON line: each engine's speculation counters (`SpecStats.as_dict`) and whether the
four outputs are equal.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from specdistill.drafts.eagle3.head import Eagle3Head
from specdistill.eval.engine import generate
from specdistill.eval.round_stats import SpecStats
from specdistill.eval.vllm_engine import VllmSettings
from specdistill.eval.vllm_speculate import VllmSpeculation

NEW_TOKENS, GAMMA = 32, 3


def total(stats: list[SpecStats]) -> dict:
    """The per-request counters summed, as one request's."""
    out = SpecStats()
    for s in stats:
        out.num_spec_steps += s.num_spec_steps
        out.num_draft_tokens += s.num_draft_tokens
        out.num_accepted_draft_tokens += s.num_accepted_draft_tokens
        hist = s.acceptance_histogram
        out.acceptance_histogram += [0] * (len(hist) - len(out.acceptance_histogram))
        for j, v in enumerate(hist):
            out.acceptance_histogram[j] += v
    return out.as_dict()


def main(target_dir: str, head_dir: str, export_dir: str, prompts_json: str) -> None:
    prompts = json.loads(open(prompts_json).read())
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    head = Eagle3Head.from_pretrained(head_dir)
    ours = generate(target, head, prompts, gamma=GAMMA, max_new_tokens=NEW_TOKENS)
    alone = generate(target, None, prompts, max_new_tokens=NEW_TOKENS)
    settings = VllmSettings(kv_cache_gib=1, max_num_seqs=len(prompts))
    results = {}
    for name, draft in (("vllm", export_dir), ("vllm_alone", None)):
        engine = VllmSpeculation(target_dir, settings, draft=draft, gamma=GAMMA)
        results[name] = engine.generate(
            prompts, temperature=0.0, max_new_tokens=NEW_TOKENS, eos_token_id=None
        )
        engine.close()
    outputs = [ours.sequences, alone.sequences] + [r.sequences for r in results.values()]
    print(
        json.dumps(
            {
                "ours": total(ours.stats),
                "vllm": results["vllm"].stats.as_dict(),
                "equal": all(o == alone.sequences for o in outputs),
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:5])
