"""Latency of `specdistill serve` at several --threads settings while other work burns cores.

    python -m benchmarks.serve_threads --target embedded:code-deep --draft runs/code/final
    python -m benchmarks.serve_threads --untrained-like code-deep --threads 2,1,default --burn 1

One server per `--threads` value ("default": no flag, the server chooses), each a
`specdistill serve` subprocess on 127.0.0.1. `--burn N` processes spin a core each from
before the servers start to the end (`--burner spin`: a Python loop, one core each; `torch`:
matrix products on torch's threads, as a training run on the same machine).
Each server's start-up (launch to /health answering) and first request are timed, then
`--requests` identical greedy completions go round the servers one at a time (server A, B,
C, A, B, ...), so a drift of the machine's speed is spread over all of them.

`--untrained-like NAME` serves a randomly initialised model of the embedded spec NAME's
architecture (its family's tokenizer must be cached, i.e. any model of the family built
once): the timing of a decoding step does not depend on the weights, and it needs no
build. With it the draft defaults to none (a random draft would accept nothing).

Printed: a markdown table, one row per setting: start-up s, first request s, the requests'
latency min / median / max s, and the completion tokens per request. `--results` writes it
into its section of benchmarks/RESULTS.md (benchmarks/results.py).
"""

import argparse
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import results as results_md

HEADER = ["--threads", "start-up s", "first request s", "latency min / median / max s", "tokens"]


def table(rows: dict) -> list[list[str]]:
    """The cells of HEADER, one row per `--threads` setting of `rows` (`startup_s`,
    `first_s`, `latency_s`: every request's seconds, `tokens`)."""
    cells = []
    for threads, r in rows.items():
        lat = r["latency_s"]
        spread = f"{min(lat):.2f} / {statistics.median(lat):.2f} / {max(lat):.2f}"
        cells.append(
            [
                str(threads),
                f"{r['startup_s']:.1f}",
                f"{r['first_s']:.2f}",
                spread,
                str(r["tokens"]),
            ]
        )
    return cells


def results_section(setting: str, cells: list[list[str]]) -> results_md.Section:
    """This run's section of RESULTS.md: the setting and the table `main` prints."""
    return results_md.Section(
        key="serve_threads",
        title="`specdistill serve` latency by `--threads`",
        body=f"{setting}.\n\n{results_md.markdown_table(HEADER, cells)}\n",
    )


def _burn(kind: str) -> None:
    """Keep the CPU busy: a Python loop on one core ("spin"), or a torch job on every core
    ("torch": matrix products on torch's default threads, as a training run does)."""
    if kind == "spin":
        while True:
            pass
    import torch

    a = torch.randn(256, 256)
    while True:
        a = torch.tanh(a @ a)


def untrained_like(name: str, out: Path) -> str:
    """A random-weight model of embedded spec `name`'s architecture, saved into `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdistill.models.embedded import BUILD_RECORD, EMBEDDED, EOS, cache_root

    spec = EMBEDDED[name]
    tokenizer_dir = cache_root() / "embedded" / "tokenizers" / spec.corpus.name
    if not (tokenizer_dir / "tokenizer.json").is_file():
        sys.exit(f"no cached tokenizer {tokenizer_dir}: build a model of {name}'s family once")
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=None,  # a random model must not stop early: every request is as long
        pad_token_id=eos,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for file in tokenizer_dir.iterdir():
        if file.name != BUILD_RECORD:
            shutil.copy2(file, out / file.name)
    return str(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(target, draft, threads, log_path: Path):
    """(process, base URL, start-up seconds): launched and answering /health."""
    port = _free_port()
    cmd = [sys.executable, "-m", "specdistill", "serve", "--target", target, "--draft", draft]
    cmd += ["--port", str(port), "--gamma", "4"] if draft != "none" else ["--port", str(port)]
    if threads != "default":
        cmd += ["--threads", threads]
    start = time.perf_counter()
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log_path.open("w"))
    url = f"http://127.0.0.1:{port}"
    while True:
        if process.poll() is not None:
            sys.exit(f"server --threads {threads} exited: see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url, time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def request(url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    seconds = time.perf_counter() - start
    response.raise_for_status()
    return seconds, response.json()["usage"]["completion_tokens"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default=None)
    parser.add_argument("--draft", default=None, help="default: none with --untrained-like")
    parser.add_argument("--untrained-like", default=None, help="an embedded spec name")
    parser.add_argument("--threads", default="default,1", help='comma-separated; "default"')
    parser.add_argument("--burn", type=int, default=1, help="processes kept busy meanwhile")
    parser.add_argument("--burner", default="spin", choices=["spin", "torch"], help="see _burn")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt", default="def fibonacci(n):\n")
    parser.add_argument("--json", default=None, help="also write the measurements here")
    results_md.add_argument(parser)
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="serve_threads-"))
    target = args.target
    if args.untrained_like:
        target = untrained_like(args.untrained_like, tmp / "model")
    if target is None:
        parser.error("give --target or --untrained-like")
    draft = args.draft or ("none" if args.untrained_like else "embedded:code-deep-draft")
    settings = args.threads.split(",")
    burners = [
        multiprocessing.Process(target=_burn, args=(args.burner,), daemon=True)
        for _ in range(args.burn)
    ]
    for b in burners:
        b.start()
    servers, rows = {}, {}
    try:
        for threads in settings:
            process, url, startup = start_server(target, draft, threads, tmp / f"{threads}.log")
            servers[threads] = (process, url)
            first, _ = request(url, target, args.prompt, args.max_tokens)
            rows[threads] = {"startup_s": startup, "first_s": first, "latency_s": [], "tokens": 0}
        for _ in range(args.requests):
            for threads, (_, url) in servers.items():
                seconds, tokens = request(url, target, args.prompt, args.max_tokens)
                rows[threads]["latency_s"].append(seconds)
                rows[threads]["tokens"] = tokens
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)
        for b in burners:
            b.terminate()
    setting = (
        f"{args.requests} identical greedy requests of {args.max_tokens} tokens, {args.burn} "
        f"{args.burner} process(es) meanwhile, {os.cpu_count()} cores; "
        f"target {args.untrained_like or target}"
    )
    print(setting)
    cells = table(rows)
    print()
    print(results_md.markdown_table(HEADER, cells))
    if args.results:
        section = results_section(setting, cells)
        print(f"wrote {results_md.write(section, args.results)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
