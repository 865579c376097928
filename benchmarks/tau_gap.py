r"""Where a draft's accepted length is lost: by chain position and by the target's entropy.

Each draft samples its own γ-token chains from prefixes of held-out text (the chains the
accepted-length objective trains on, drafts/chains.py) at temperature T; the target scores
them. Per chain position k it reports α_k (Σ min(p, q) at that position of the draft's own
chain), r_k (min(1, p/q) of the sampled token) and the chance that the round reaches k
(Π_{j<k} r_j), whose sum is the expected accepted length L; and α by the target's entropy
at the position (nats). The first draft is the baseline of the ratio columns.

    python -m benchmarks.tau_gap --target embedded:code-deep \
        --draft fkl=runs/study25/code/fkl-seed0/final \
        --draft lk+tau=runs/study25/code/lk+tau-seed0/final --gamma 5 --sequences 32
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

from benchmarks import results
from specdistill.data.dataset import build_datasets, collate
from specdistill.drafts import loader
from specdistill.drafts.chains import sample_chains
from specdistill.losses.chain import row_terms
from specdistill.models import hub
from specdistill.verb_parser import quiet_third_party

ENTROPY_EDGES = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, float("inf"))


@dataclass
class Gap:
    """Sums over the valid chains of one draft."""

    gamma: int
    n: int = 0
    alpha: torch.Tensor = None  # [γ] Σ α_k
    r: torch.Tensor = None  # [γ−1] Σ r_k
    reach: torch.Tensor = None  # [γ] Σ Π_{j<k} r_j
    length: float = 0.0  # Σ L = Σ_k Π_{j<k} r_j · α_k
    by_entropy: dict = field(default_factory=dict)  # bin -> [Σ α, count]

    def __post_init__(self):
        self.alpha = torch.zeros(self.gamma, dtype=torch.float64)
        self.r = torch.zeros(self.gamma - 1, dtype=torch.float64)
        self.reach = torch.zeros(self.gamma, dtype=torch.float64)
        self.by_entropy = {i: [0.0, 0] for i in range(len(ENTROPY_EDGES) - 1)}

    def add(self, draft_logp, target_logp, tokens, mask) -> None:
        terms = row_terms(draft_logp[mask], target_logp[mask], tokens[mask])
        alpha, r = terms.log_alpha.exp().double(), terms.log_r.exp().double()
        reach = torch.cat([torch.ones_like(alpha[:, :1]), r.cumprod(-1)], -1)
        self.n += int(mask.sum())
        self.alpha += alpha.sum(0)
        self.r += r.sum(0)
        self.reach += reach.sum(0)
        self.length += float((reach * alpha).sum())
        p = target_logp[mask].exp()
        entropy = -(p * target_logp[mask].clamp_min(-1e4)).sum(-1).double()  # [n, γ]
        for i in self.by_entropy:
            lo, hi = ENTROPY_EDGES[i], ENTROPY_EDGES[i + 1]
            inside = (entropy >= lo) & (entropy < hi)
            self.by_entropy[i][0] += float(alpha[inside].sum())
            self.by_entropy[i][1] += int(inside.sum())


def expected_length(gap: Gap) -> float:
    """Expected accepted draft tokens per round, E[Σ_k Π_{j<k} r_j · α_k]."""
    return gap.length / max(gap.n, 1)


@torch.no_grad()
def measure(target, draft, batches, *, gamma, temperature, starts, vocab_size, seed) -> Gap:
    gap = Gap(gamma)
    g = torch.Generator().manual_seed(seed)
    for batch in batches:
        length = batch["input_ids"].shape[1]
        columns = torch.randperm(length - 1, generator=g)[:starts].sort().values.tolist()
        chains = sample_chains(
            draft,
            target,
            batch,
            columns,
            gamma=gamma,
            temperature=temperature,
            vocab_size=vocab_size,
            generator=g,
        )
        d = (chains.draft.float() / temperature).log_softmax(-1)
        t = (chains.target.float() / temperature).log_softmax(-1)
        gap.add(d, t, chains.tokens, chains.mask)
    return gap


def held_out_batches(tokenizer, data: str, max_length: int, sequences: int) -> list[dict]:
    """The first `sequences` packed sequences of `data`'s held-out split, in batches of 8."""
    _, held = build_datasets(tokenizer, data, data, max_length=max_length, pack=True)
    items = [held[i] for i in range(min(sequences, len(held)))]
    return [collate(items[i : i + 8], tokenizer.pad_token_id) for i in range(0, len(items), 8)]


def load_target_and_text(args: argparse.Namespace):
    """The parsed command line's target (eval mode) and its held-out batches; sets
    `--threads` and quiets third-party logging first."""
    quiet_third_party()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = hub.load_tokenizer(args.target)
    target = hub.load_target(args.target, None).eval()
    return target, held_out_batches(tokenizer, args.data, args.max_length, args.sequences)


def table(gaps: dict[str, Gap]) -> str:
    names = list(gaps)
    base = gaps[names[0]]
    gamma = base.gamma
    head = ["draft", "L (accepted / round)", "L / first"]
    head += [f"α{k + 1}" for k in range(gamma)] + [f"reach {k + 1}" for k in range(gamma)]
    rows = []
    for name, gap in gaps.items():
        length = expected_length(gap)
        ratio = length / expected_length(base) if expected_length(base) > 0 else float("nan")
        row = [name, f"{length:.3f}", f"{ratio:.3f}"]
        row += [f"{float(a) / gap.n:.3f}" for a in gap.alpha]
        row += [f"{float(x) / gap.n:.3f}" for x in gap.reach]
        rows.append(row)
    first = results.markdown_table(head, rows)
    head2 = ["draft"] + [
        f"H∈[{ENTROPY_EDGES[i]:g},{ENTROPY_EDGES[i + 1]:g})" for i in base.by_entropy
    ]
    rows2 = [["positions"] + [str(base.by_entropy[i][1]) for i in base.by_entropy]]
    for name, gap in gaps.items():
        rows2.append(
            [name]
            + [f"{s / max(c, 1):.3f}" for s, c in (gap.by_entropy[i] for i in gap.by_entropy)]
        )
    second = results.markdown_table(head2, rows2)
    return (
        f"By chain position (α_k on the draft's own chain, reach k = Π_(j<k) r_j):\n\n{first}\n"
        f"α by the target's entropy at the position (nats; the first draft's chain "
        f"positions counted):\n\n{second}"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="embedded:code-deep")
    parser.add_argument("--draft", action="append", required=True, help="LABEL=PATH")
    parser.add_argument("--data", default="embedded:code-heldout")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--starts", type=int, default=32, help="chain starts per batch")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    results.add_argument(parser)
    args = parser.parse_args(argv)
    target, batches = load_target_and_text(args)
    gaps = {}
    for spec in args.draft:
        label, _, path = spec.partition("=")
        draft = loader.load_draft(path).eval()
        vocab = min(target.config.vocab_size, draft.config.vocab_size)
        gaps[label] = measure(
            target,
            draft,
            batches,
            gamma=args.gamma,
            temperature=args.temperature,
            starts=args.starts,
            vocab_size=vocab,
            seed=args.seed,
        )
    text = table(gaps)
    print(text)
    if args.results:
        n = sum(len(b["input_ids"]) for b in batches)
        body = (
            f"Target {args.target}, {n} held-out sequences of {args.data}, "
            f"{args.starts} chain starts per batch of 8, γ = {args.gamma}, "
            f"T = {args.temperature:g}.\n\n{text}\n"
        )
        results.write(
            results.Section("tau_gap", "Where accepted length is lost", body), args.results
        )


if __name__ == "__main__":
    main()
