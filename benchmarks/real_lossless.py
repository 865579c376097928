"""Losslessness on a real pair: greedy output equals the target's, and sampled tokens follow
the target's distribution (χ²).

    python -m benchmarks.real_lossless --target registry:smollm2-135m-instruct \\
        --draft runs/smollm2-standalone/final --gamma 3

1. Greedy: `--num-prompts` HumanEval prompts, `--max-new-tokens` each, speculative decoding
   against the target alone: the token sequences must be identical.
2. T = 1: for `--chi-prompts` prompts (the last `--chi-prompt-tokens` tokens of each),
   `--samples` rows of the same prompt decode 2 tokens with speculation (one seed per
   prompt); the first token's counts are compared with the target's own next-token
   distribution by a χ² test (tokens expected at least 5 times are their own category, the
   rest one category). A p-value above 1e-3 for every prompt is a pass; the draft's
   proposals were accepted for part of the rows (shown), so the test exercises acceptance and
   the residual both.
"""

import argparse
import gzip
import json

import torch
from scipy.stats import chisquare

from specdistill.drafts.loader import load_draft
from specdistill.eval import engine
from specdistill.models.hub import load_target, load_tokenizer

HUMANEVAL = "benchmarks/prompts/HumanEval.jsonl.gz"


def prompts(tokenizer, n: int, keep: int) -> list[list[int]]:
    """The last `keep` tokens of the first `n` HumanEval prompts."""
    with gzip.open(HUMANEVAL, "rt") as f:
        texts = [json.loads(line)["prompt"] for line in f][:n]
    return [tokenizer.encode(t, add_special_tokens=False)[-keep:] for t in texts]


def chi_square(target, draft, prompt: list[int], samples: int, gamma: int, seed: int):
    """(p-value, categories, share of rows whose first draft token was accepted)."""
    out = engine.generate(
        target, draft, [prompt] * samples, gamma=gamma, temperature=1.0,
        max_new_tokens=2, seed=seed, batch_size=samples,
    )  # fmt: skip
    first = torch.tensor([s[0] for s in out.sequences])
    p = target(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)
    expected = p * samples
    own = expected >= 5
    counts = torch.bincount(first, minlength=p.shape[0]).double()
    observed = torch.cat([counts[own], counts[~own].sum().view(1)])
    wanted = torch.cat([expected[own], expected[~own].sum().view(1)])
    keep = wanted > 0
    pvalue = chisquare(
        observed[keep].numpy(),
        wanted[keep].numpy() * observed.sum().item() / wanted[keep].sum().item(),
    ).pvalue
    accepted = [n for r in out.rounds for n, s in zip(r.accepted, r.starts, strict=True) if s == 0]
    return float(pvalue), int(keep.sum()), sum(n > 0 for n in accepted) / max(1, len(accepted))


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="registry:smollm2-135m-instruct")
    parser.add_argument("--draft", required=True)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--chi-prompts", type=int, default=3)
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument(
        "--chi-prompt-tokens", type=int, default=24, help="χ² prompts: their last N tokens"
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = load_target(args.target), load_draft(args.draft)
    tokenizer = load_tokenizer(args.target)
    batch = prompts(tokenizer, args.num_prompts, 256)
    alone = engine.generate(target, None, batch[: args.num_prompts], gamma=0,
                            max_new_tokens=args.max_new_tokens)  # fmt: skip
    spec = engine.generate(target, draft, batch[: args.num_prompts], gamma=args.gamma,
                           max_new_tokens=args.max_new_tokens)  # fmt: skip
    same = sum(a == b for a, b in zip(alone.sequences, spec.sequences, strict=True))
    print(f"greedy: {same}/{args.num_prompts} prompts identical to the target alone "
          f"({args.max_new_tokens} tokens each, γ = {args.gamma})")  # fmt: skip
    for i, prompt in enumerate(prompts(tokenizer, args.chi_prompts, args.chi_prompt_tokens)):
        pvalue, k, accepted = chi_square(target, draft, prompt, args.samples, args.gamma, i)
        print(f"T = 1, prompt {i}: χ² p = {pvalue:.3f} over {k} categories, {args.samples} "
              f"samples; first draft token accepted in {accepted:.0%} of rows")  # fmt: skip


if __name__ == "__main__":
    main()
