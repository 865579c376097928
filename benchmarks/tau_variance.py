r"""The accepted-length objective's gradient noise on a real draft, by baseline and by chains
per start (losses/chain.py; docs/theory.md, "The accepted-length objective").

Every estimator here is unbiased (tests/losses/test_chain.py checks each against the exact
gradient), so they differ only in variance. For each configuration the draft's gradient of
the chain loss is computed `--repeats` times, each on freshly drawn starts and chains of the
same batches, at an equal number of chains (with k chains per start, 1/k as many starts);
reported: the total variance of one gradient (the trace of its covariance, summed over the
draft's parameters), relative to the first configuration's, and the squared norm of the mean
gradient (the signal).

    python -m benchmarks.tau_variance --draft runs/code/final --repeats 24
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks import results
from benchmarks.tau_gap import load_target_and_text
from specdistill.drafts import loader
from specdistill.drafts.chains import prefix_groups, sample_chains
from specdistill.losses.chain import chain_weights, row_terms, weighted_terms

CONFIGS = (("reward", 1), ("coefficient", 1), ("reward", 2), ("coefficient", 2))


def gradient(draft, target, batch, starts, per_start, baseline, *, gamma, vocab, g) -> torch.Tensor:
    """The flattened gradient of the mean chain loss 1 − L/γ over one batch's chains."""
    repeated = sorted(s for s in starts for _ in range(per_start))
    chains = sample_chains(
        draft, target, batch, repeated, gamma=gamma, temperature=1.0, vocab_size=vocab,
        generator=g,
    )  # fmt: skip
    terms = row_terms(chains.draft.float().log_softmax(-1), chains.target.float().log_softmax(-1),
                      chains.tokens)  # fmt: skip
    groups = prefix_groups(repeated, len(batch["input_ids"])) if per_start > 1 else None
    weights = chain_weights(terms.log_r, terms.log_alpha, chains.mask, "score", groups, baseline)
    loss = -weighted_terms(terms, weights).sum() / gamma / chains.mask.sum().clamp_min(1)
    params = [p for p in draft.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(gr if gr is not None else torch.zeros_like(p)).reshape(-1)
                      for gr, p in zip(grads, params, strict=True)])  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="embedded:code-deep")
    parser.add_argument("--draft", required=True)
    parser.add_argument("--data", default="embedded:code-heldout")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--chains", type=int, default=32, help="chains per row of a batch")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=24)
    parser.add_argument("--threads", type=int, default=None)
    results.add_argument(parser)
    args = parser.parse_args(argv)
    target, batches = load_target_and_text(args)
    draft = loader.load_draft(args.draft).eval()
    vocab = min(target.config.vocab_size, draft.config.vocab_size)
    rows, first = [], None
    for baseline, per_start in CONFIGS:
        t0, g = time.time(), torch.Generator().manual_seed(0)
        samples = []
        for _ in range(args.repeats):
            total = 0.0
            for batch in batches:
                length = batch["input_ids"].shape[1]
                n = args.chains // per_start
                starts = torch.randperm(length - 1, generator=g)[:n].tolist()
                total = total + gradient(draft, target, batch, starts, per_start, baseline,
                                         gamma=args.gamma, vocab=vocab, g=g)  # fmt: skip
            samples.append(total / len(batches))
        stack = torch.stack(samples).double()
        variance = float(stack.var(0).sum())
        signal = float(stack.mean(0).pow(2).sum())
        first = first if first is not None else variance
        rows.append([baseline, str(per_start), f"{variance:.3e}", f"{variance / first:.2f}",
                     f"{signal:.3e}", f"{time.time() - t0:.0f}"])  # fmt: skip
        print(" | ".join(rows[-1]), flush=True)
    head = ["baseline", "chains / start", "gradient variance", "÷ first", "|mean|²", "s"]
    text = results.markdown_table(head, rows)
    print(text)
    if args.results:
        body = (
            f"Target {args.target}, draft {args.draft}, {args.sequences} held-out sequences of "
            f"{args.data} ({args.max_length} tokens), {args.chains} chains per row, "
            f"γ = {args.gamma}, T = 1, {args.repeats} repeats.\n\n{text}\n"
        )
        results.write(
            results.Section("tau_variance", "The accepted-length gradient's noise", body),
            args.results,
        )


if __name__ == "__main__":
    main()
