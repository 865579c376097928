"""Load test of `specdistill serve`: M concurrent clients for S seconds, with and without draft.

    python -m benchmarks.serve_load        # embedded:code-deep + embedded:code-deep-draft
    python -m benchmarks.serve_load --clients 8 --seconds 20 --max-tokens 64 --temperature 0
    python -m benchmarks.serve_load --target Qwen/Qwen2.5-1.5B --draft Qwen/Qwen2.5-0.5B \\
        --device cuda --dtype bfloat16

Starts the server on 127.0.0.1 (a free port, loopback only) with a traffic log, runs M client
threads (the official openai client, streaming, so TTFT is measured on the client side) that
send HumanEval prompts one after another for S seconds (a request in flight at the end
completes), stops, then does the same with `--draft none`. Printed per server: requests
served, failures (must be 0), records logged (must equal requests served), p50 / p95
latency and TTFT, generated tokens/s, the server's mean acceptance length; and the tokens/s
ratio speculative ÷ target alone. Exit status 1 when a check fails.
"""

import argparse
import statistics
import sys
import tempfile
import threading
import time

from specdistill.eval.prompts import encode_prompts, load_prompts
from specdistill.serve.server import Server
from specdistill.serve.traffic import read_traffic


def percentile(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def run_load(args, draft: str, prompts: list[list[int]]) -> dict:
    import openai

    traffic = tempfile.mkdtemp(prefix="serve-load-traffic-")
    server = Server(
        args.target,
        draft,
        gamma=args.gamma,
        max_batch=args.max_batch,
        traffic=traffic,
        dtype=args.dtype,
        device=args.device,
        model_name="m",
    )
    url = server.start("127.0.0.1", 0)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    results, failures, lock = [], [], threading.Lock()
    # warm-up (not counted): one request
    client.completions.create(model="m", prompt=prompts[0], max_tokens=4, temperature=0)
    logged_before = len(read_traffic(traffic))
    deadline = time.monotonic() + args.seconds

    def worker(i: int):
        n = i
        while time.monotonic() < deadline:
            prompt = prompts[n % len(prompts)]
            n += args.clients
            start = time.perf_counter()
            ttft, tokens, spec = None, 0, None
            try:
                stream = client.completions.create(
                    model="m",
                    prompt=prompt,
                    max_tokens=args.max_tokens,
                    temperature=args.temperature,
                    seed=n,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].text and ttft is None:
                        ttft = time.perf_counter() - start
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                        spec = (chunk.model_extra or {}).get("metrics")
                latency = time.perf_counter() - start
                with lock:
                    results.append((latency, ttft if ttft is not None else latency, tokens, spec))
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                with lock:
                    failures.append(repr(e))

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    server.stop()
    logged = len(read_traffic(traffic)) - logged_before
    lat = [r[0] for r in results]
    ttft = [r[1] for r in results]
    tokens = sum(r[2] for r in results)
    steps = sum(r[3]["speculative_decoding"]["num_spec_steps"] for r in results if r[3])
    accepted = sum(
        r[3]["speculative_decoding"]["num_accepted_draft_tokens"] for r in results if r[3]
    )
    return {
        "draft": draft,
        "served": len(results),
        "failures": len(failures),
        "failure_examples": failures[:3],
        "logged": logged,
        "p50_latency_s": percentile(lat, 0.5),
        "p95_latency_s": percentile(lat, 0.95),
        "p50_ttft_s": percentile(ttft, 0.5),
        "p95_ttft_s": percentile(ttft, 0.95),
        "mean_latency_s": statistics.fmean(lat) if lat else float("nan"),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "mean_acceptance_length": 1 + accepted / steps if steps else None,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="embedded:code-deep")
    parser.add_argument("--draft", default="embedded:code-deep-draft")
    parser.add_argument("--prompts", default="benchmarks/prompts/HumanEval.jsonl.gz")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients (M)")
    parser.add_argument("--seconds", type=float, default=20.0, help="per server (S, <= 600)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if not 0 < args.seconds <= 600:
        parser.error("--seconds must be in (0, 600]")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from specdistill.drafts.hub import load_tokenizer

    tokenizer = load_tokenizer(args.target)
    prompts = encode_prompts(
        load_prompts(args.prompts, limit=args.num_prompts),
        tokenizer,
        max_tokens=args.max_prompt_tokens,
    )
    runs = [run_load(args, args.draft, prompts), run_load(args, "none", prompts)]
    ok = True
    print(
        f"{args.clients} clients x {args.seconds:.0f} s, max_tokens {args.max_tokens}, "
        f"temperature {args.temperature}, gamma {args.gamma}, target {args.target}"
    )
    header = (
        "draft",
        "served",
        "failures",
        "logged",
        "p50 lat",
        "p95 lat",
        "p50 ttft",
        "p95 ttft",
        "tok/s",
        "mean acc len",
    )
    print(" | ".join(header))
    for r in runs:
        acc = r["mean_acceptance_length"]
        print(
            " | ".join(
                [
                    r["draft"],
                    str(r["served"]),
                    str(r["failures"]),
                    str(r["logged"]),
                    f"{r['p50_latency_s']:.3f}",
                    f"{r['p95_latency_s']:.3f}",
                    f"{r['p50_ttft_s']:.3f}",
                    f"{r['p95_ttft_s']:.3f}",
                    f"{r['tokens_per_s']:.1f}",
                    "-" if acc is None else f"{acc:.2f}",
                ]
            )
        )
        if r["failures"]:
            ok = False
            print("  failures, e.g.:", *r["failure_examples"], sep="\n    ")
        if r["logged"] != r["served"]:
            ok = False
            print(f"  records logged {r['logged']} != requests served {r['served']}")
    ratio = runs[0]["tokens_per_s"] / runs[1]["tokens_per_s"]
    print(f"tokens/s ratio, speculative / target alone: {ratio:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
