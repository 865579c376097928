"""Where a speculative decoding run spends its time, per dtype: torch's profiler over the
engine's `generate` on one device.

    python -m benchmarks.gpu_profile --target embedded:code-deep --draft runs/code/final \\
        --device cuda --dtypes float32,bfloat16,float16 --out OUT_DIR

For each dtype it loads the pair, warms up, times `generate` (target alone, then γ = 4) over
the same prompts, and profiles the γ = 4 run. It prints, per dtype: ms per generated token for
both, the ratio against the first dtype's, the operators that took the most self time (device
time on a GPU, host time otherwise), and per generated token the counts that make a small
model slow where its arithmetic is cheap: dtype conversions (`aten::_to_copy`), scalar reads
of a tensor (`aten::_local_scalar_dense`: `.item()`, `int(t)`, `bool(t)`), copies between host
and device (where `.tolist()` of a device tensor shows) and stream synchronisations. Each
dtype's full table goes to OUT_DIR/profile-DTYPE.txt and the summary to OUT_DIR/profile.json.
Runs on a CPU too (host times only), which is how its test runs it.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from specdistill.drafts.loader import load_draft
from specdistill.eval.engine import generate
from specdistill.eval.prompts import encode_prompts, load_prompts
from specdistill.models.hub import load_target, load_tokenizer
from specdistill.models.kv_cache import sync

COUNTED = {  # summary key -> profiler event names counted for it
    "dtype_conversions": ("aten::_to_copy",),
    "host_reads": ("aten::_local_scalar_dense",),
    "host_device_copies": ("cudaMemcpyAsync", "cudaMemcpy"),
    "synchronisations": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
}


def timed(fn, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def profile_dtype(args, dtype: str, prompts: list[list[int]]) -> tuple[dict, str]:
    """One dtype's summary and its profiler table."""
    target = load_target(args.target, dtype=dtype).to(args.device).eval()
    draft = load_draft(args.draft, dtype=dtype).to(args.device).eval()
    device = torch.device(args.device)
    run = dict(max_new_tokens=args.max_new_tokens, temperature=0.0, batch_size=args.batch_size)
    with torch.no_grad():
        generate(target, draft, prompts, gamma=4, **{**run, "max_new_tokens": 8})  # warm-up
        alone: list = []
        t_alone = timed(lambda: alone.append(generate(target, None, prompts, **run)), device)
        spec: list = []
        t_spec = timed(
            lambda: spec.append(generate(target, draft, prompts, gamma=4, **run)), device
        )
        activities = [ProfilerActivity.CPU]
        if args.device.startswith("cuda"):
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            generate(target, draft, prompts, gamma=4, **run)
    tokens, tokens_alone = spec[0].n_tokens, alone[0].n_tokens  # generated tokens
    events = prof.key_averages()
    counts = {
        key: sum(e.count for e in events if e.key in names) / max(tokens, 1)
        for key, names in COUNTED.items()
    }
    sort = "self_cuda_time_total" if ProfilerActivity.CUDA in activities else "self_cpu_time_total"
    summary = {
        "dtype": dtype,
        "ms_per_token_target_alone": 1000 * t_alone / max(tokens_alone, 1),
        "ms_per_token_gamma4": 1000 * t_spec / max(tokens, 1),
        "per_token": counts,
    }
    return summary, events.table(sort_by=sort, row_limit=args.rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="embedded:code-deep")
    parser.add_argument("--draft", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--prompts", default="benchmarks/prompts/HumanEval.jsonl.gz")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rows", type=int, default=15, help="operators shown per dtype")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(args.target)
    prompts = encode_prompts(load_prompts(args.prompts, limit=args.num_prompts), tokenizer)
    summaries = []
    for dtype in args.dtypes.split(","):
        summary, table = profile_dtype(args, dtype, prompts)
        base = summaries[0]["ms_per_token_gamma4"] if summaries else summary["ms_per_token_gamma4"]
        summary["gamma4_vs_first_dtype"] = summary["ms_per_token_gamma4"] / base
        summaries.append(summary)
        (out / f"profile-{dtype}.txt").write_text(table)
        print(json.dumps(summary))
        print(table)
    (out / "profile.json").write_text(json.dumps(summaries, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
