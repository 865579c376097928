"""What a round's drafting costs: the parallel drafter (one forward for γ drafts) against the
standalone drafter (γ forwards), next to the target's verification forward.

    python -m benchmarks.parallel_cost --threads 1 --gammas 1,2,3,4,6 --repeats 30

Models of the embedded default's shapes (models/embedded_specs.py: the 20-layer `code-deep`
target, the 1-layer `code-deep-draft`) with random weights: only the cost is measured here,
not acceptance, so no trained model is needed. Batch of one row with a 128-token prompt, the
engine's own drafters and KV streams (the lean CPU forward), greedy drafting; each round is
proposed, verified by one target forward of γ + 1 tokens and rolled back as if nothing was
accepted, so every round starts from the same cache. The three timings of a round are taken
back to back and every configuration is repeated, interleaved; medians are printed.
`--results` writes the table into its section of benchmarks/RESULTS.md (benchmarks/results.py).
"""

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks import results as results_md
from specdistill.drafts.parallel import ParallelDrafter, add_mask_token
from specdistill.drafts.standalone import StandaloneDrafter
from specdistill.models.kv_cache import KVStream

VOCAB = 4096


def model(layers: int, heads: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=1024,
    )
    return LlamaForCausalLM(config).eval()


def greedy(logits):
    return logits.argmax(-1), None


@torch.no_grad()
def round_times(drafter, target_stream, gamma: int) -> tuple[float, float]:
    """(draft seconds, verify seconds) of one round; both caches are rolled back after."""
    start = time.perf_counter()
    proposal = drafter.propose(gamma, greedy)
    drafted = time.perf_counter()
    tokens = torch.cat([torch.zeros(1, 1, dtype=torch.long), proposal.tokens], dim=1)
    target_stream.forward(tokens, torch.ones_like(tokens, dtype=torch.bool), keep=gamma + 1)
    verified = time.perf_counter()
    target_stream.drop_last(torch.tensor([gamma + 1]))
    n = torch.zeros(1, dtype=torch.long)
    last = proposal.tokens[0].tolist()
    drafter.commit(gamma, n, [[0, 0, *last]])
    drafter.pending = [[1]]  # the same start for the next round
    return drafted - start, verified - drafted


HEADER = [
    "γ",
    "standalone draft ms",
    "parallel draft ms",
    "parallel / standalone",
    "verify ms",
    "standalone draft share",
    "parallel draft share",
]


def table(times: dict, gammas: list[int]) -> list[list[str]]:
    """The rows of HEADER from the timings: medians in ms, ratios and draft shares of a round.
    `times[kind, γ]` is two lists, draft seconds and verify seconds, one entry per repeat."""
    rows = []
    for g in gammas:
        s = statistics.median(times["standalone", g][0]) * 1e3
        p = statistics.median(times["parallel", g][0]) * 1e3
        v = statistics.median(times["standalone", g][1] + times["parallel", g][1]) * 1e3
        rows.append(
            [
                str(g),
                f"{s:.2f}",
                f"{p:.2f}",
                f"{p / s:.2f}",
                f"{v:.2f}",
                f"{s / (s + v):.2f}",
                f"{p / (p + v):.2f}",
            ]
        )
    return rows


def results_section(rows: list[list[str]], repeats: int, threads: int) -> results_md.Section:
    """This run's section of RESULTS.md: the setting and the table `main` prints."""
    setting = (
        f"Models of the embedded default's shapes with random weights (a 20-layer target, a "
        f"1-layer draft); batch 1, 128-token prompt, greedy drafting; medians of {repeats} "
        f"interleaved rounds per configuration, {threads} thread(s), every configuration in "
        "the same run."
    )
    return results_md.Section(
        key="parallel_cost",
        title="The drafting cost of a round: parallel against standalone drafts",
        body=f"{setting}\n\n{results_md.markdown_table(HEADER, rows)}\n",
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gammas", default="1,2,3,4,6")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    results_md.add_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gammas = [int(g) for g in args.gammas.split(",")]
    target, draft = model(20, 4, 0), model(1, 2, 1)
    parallel = model(1, 2, 1)
    add_mask_token(parallel)
    prompt = torch.randint(0, VOCAB, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    cpu = torch.device("cpu")
    target_stream = KVStream(target, VOCAB, cpu)
    target_stream.admit([prompt])
    drafters = {
        "standalone": StandaloneDrafter(draft, VOCAB, cpu),
        "parallel": ParallelDrafter(parallel, VOCAB, cpu),
    }
    for d in drafters.values():
        d.admit([prompt])
    times = {(k, g): ([], []) for k in drafters for g in gammas}
    for _ in range(3):  # warm-up
        for d in drafters.values():
            round_times(d, target_stream, 2)
    for _ in range(args.repeats):
        for g in gammas:
            for kind, d in drafters.items():
                draft_s, verify_s = round_times(d, target_stream, g)
                times[kind, g][0].append(draft_s)
                times[kind, g][1].append(verify_s)
    rows = table(times, gammas)
    print(f"median of {args.repeats} rounds, {args.threads} thread(s); ms per round")
    print(results_md.markdown_table(HEADER, rows))
    if args.results:
        section = results_section(rows, args.repeats, args.threads)
        print(f"wrote {results_md.write(section, args.results)}")


if __name__ == "__main__":
    main()
