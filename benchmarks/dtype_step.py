"""A decoding step and a verification pass of the lean CPU forward, float32 against bfloat16.

    python -m benchmarks.dtype_step --target registry:smollm2-135m-instruct --threads 1
    python -m benchmarks.dtype_step --target registry:smollm2-135m-instruct --threads 1 \\
        --half-k-major      # bfloat16 without the prepacked kernel below PACKED_FROM rows

After a 64-token prefill, batch 1, it times forwards of k = 1 and k = 5 new tokens (rolled
back after each), the median of 20 after 5 warm-up ones, in each dtype, and prints their
times and the bfloat16 / float32 ratio (models/lean.py `packed_from`). Run it alone on the
machine: any other process moves the numbers.
"""

import argparse
import statistics
import time

import torch

from specdistill.models import lean
from specdistill.models.hub import load_target
from specdistill.models.kv_cache import KVStream


def step_ms(model, k: int, repeats: int = 25) -> float:
    stream = KVStream(model, model.config.vocab_size, torch.device("cpu"))
    stream.admit([list(range(100, 164))])
    tokens = torch.arange(k).view(1, k) + 7
    valid = torch.ones(1, k, dtype=torch.bool)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        stream.forward(tokens, valid, k)
        times.append(time.perf_counter() - start)
        stream.drop_last(torch.tensor([k]))
    return 1000 * statistics.median(times[5:])


@torch.no_grad()
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="embedded:code-deep")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--half-k-major", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.half_k_major:
        lean.HALF = ()
    ms = {}
    for dtype in ("float32", "bfloat16"):
        model = load_target(args.target, dtype=dtype).eval()
        for k in (1, 5):
            ms[dtype, k] = step_ms(model, k)
        del model
    for k in (1, 5):
        f32, bf16 = ms["float32", k], ms["bfloat16", k]
        print(f"k={k}: float32 {f32:.2f} ms, bfloat16 {bf16:.2f} ms, ratio {bf16 / f32:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
