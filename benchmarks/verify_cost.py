"""v(k): what verifying k drafted tokens costs the target, against one decoding step.

    python -m benchmarks.verify_cost --target registry:smollm2-135m-instruct --threads 1

For each forward (transformers' own; the lean CPU forward with the K-major layout only; with
the row-major layout for 2..FEW_ROWS rows and no prepacked weights; as shipped, oneDNN's
prepacked weights from 3 rows, or from 2 where this machine measured them faster there,
see models/lean.py `packed_from`, SDPA for the attention of one sequence; and the same with
models/attention.py's matrix products for one sequence too) it times a target forward of
k + 1 tokens after `--context` cached tokens, batch 1, rolled back after each, for
k = 0..--max-k. The forwards take turns within each repeat, so a machine that slows down slows
all of them; each v(k) is the median over the repeats. Prints v(k) in ms and v(k) / v(0), the
price of a round's verification in decoding steps, and beside them the lower bound of the
same weights: one pass that reads every weight of the model once (a sum over each), what any
forward of a few rows must at least cost. Run it alone on the machine: any other process moves
the numbers.
"""

import argparse
import statistics
import time
from typing import NamedTuple

import torch

from specdistill.models import attention, lean
from specdistill.models.hub import load_target
from specdistill.models.kv_cache import KVStream


class Forward(NamedTuple):
    """One timed forward: the lean forward or transformers', and the module knobs it sets
    (each defaults to the shipped value)."""

    is_lean: bool = True  # KVStream(lean=...): the lean forward, or transformers'
    few_rows: int = lean.FEW_ROWS
    packed_from: int = lean.PACKED_FROM
    min_batch: int = attention.MIN_BATCH

    def apply(self) -> None:
        lean.FEW_ROWS, lean.PACKED_FROM, attention.MIN_BATCH = (
            self.few_rows,
            self.packed_from,
            self.min_batch,
        )


FORWARDS = {
    "transformers": Forward(is_lean=False),
    "lean, K-major layout only": Forward(few_rows=0, packed_from=0),
    "lean, row-major for 2-4 rows, no prepacked weights": Forward(packed_from=0),
    "lean, prepacked, attention as matrix products for one sequence too": Forward(min_batch=1),
    "lean as shipped (prepacked; SDPA attention for one sequence)": Forward(),
}


def weights_read_ms(model, repeats: int) -> float:
    """Median time of one pass that reads every parameter once: a forward's floor."""
    params = [p.detach() for p in model.parameters()]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for p in params:
            p.sum()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="registry:smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(args.target)  # an embedded target not built yet trains here
    torch.set_grad_enabled(False)  # the lean forward runs only without gradients
    vocab = target.config.vocab_size
    streams = {}
    for name, forward in FORWARDS.items():
        stream = KVStream(target, vocab, torch.device("cpu"), lean=forward.is_lean)
        stream.admit([[i % vocab for i in range(args.context)]])
        streams[name] = stream
    times = {name: [[] for _ in range(args.max_k + 1)] for name in FORWARDS}
    for _ in range(args.repeats):
        for k in range(args.max_k + 1):
            tokens = torch.arange(k + 1).view(1, k + 1)
            valid = torch.ones_like(tokens, dtype=torch.bool)
            for name, forward in FORWARDS.items():
                forward.apply()
                start = time.perf_counter()
                streams[name].forward(tokens, valid, keep=k + 1).float().softmax(-1)
                times[name][k].append(time.perf_counter() - start)
                streams[name].drop_last(torch.full((1,), k + 1))
    Forward().apply()  # the shipped values again
    floor = weights_read_ms(target, args.repeats)
    print(
        f"{args.target}, {args.threads} thread(s), {args.context} cached tokens, batch 1, "
        f"median of {args.repeats}; oneDNN prepacked ops available: {lean.packed_ops()}; "
        f"as shipped, float32 rows prepacked from {lean.packed_from(torch.float32)}"
    )
    print(f"| forward | {' | '.join(f'v({k})' for k in range(args.max_k + 1))} |")
    print(f"|---|{'---|' * (args.max_k + 1)}")
    for name in FORWARDS:
        v = [statistics.median(t) for t in times[name]]
        cells = [f"{x * 1e3:.0f} ms ({x / v[0]:.2f})" for x in v]
        print(f"| {name} | {' | '.join(cells)} |")
    print(f"| reading every weight once (lower bound) | {floor:.0f} ms |")


if __name__ == "__main__":
    main()
