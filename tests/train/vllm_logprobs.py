"""Run in a subprocess by tests/train/test_prepare_vllm.py (vLLM runs in its process and binds
its threads): vLLM's log-probabilities against a transformers forward of the same model, over
the tokens vLLM drew.

    python -m tests.train.vllm_logprobs MODEL_DIR DTYPE

prints one JSON line: the largest absolute differences, over every answer position, of the
top N's log-probabilities and of the drawn token's, and how many positions were compared.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdistill.eval.vllm_engine import VllmEngine, VllmSettings

TOP_N = 8
PROMPTS = ["def add(a, b):\n", "class Point:\n", "for i in range(10):\n", "import os\n"]


def main(model_dir: str, dtype: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    engine = VllmEngine(model_dir, VllmSettings(dtype=dtype, max_num_seqs=4), max_logprobs=TOP_N)
    answers = engine.generate(
        prompts,
        temperature=1.0,
        top_p=None,
        top_k=None,
        max_new_tokens=12,
        seed=0,
        eos_token_id=tokenizer.eos_token_id,
        logprobs=TOP_N,
        vocab_size=len(tokenizer),
    )
    engine.close()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    top, drawn, positions, ranks_agree = 0.0, 0.0, 0, 0
    for prompt, ids, entries in zip(prompts, answers.sequences, answers.logprobs, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0].float()
        logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        for row, token, (lp, alternatives) in zip(logprobs, ids, entries, strict=True):
            indices = torch.tensor([t for t, _ in alternatives])
            values = torch.tensor([v for _, v in alternatives])
            top = max(top, (row[indices] - values).abs().max().item())
            drawn = max(drawn, abs(row[token].item() - lp))
            ranks_agree += int(set(indices.tolist()) == set(row.topk(TOP_N).indices.tolist()))
            positions += 1
    print(json.dumps({"top": top, "drawn": drawn, "positions": positions, "same_top": ranks_agree}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
