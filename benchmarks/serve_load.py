r"""Goodput of `specdistill serve` under load: draft-length settings side by side, in one run.

    python -m benchmarks.serve_load        # embedded:code-deep + embedded:code-deep-draft
    python -m benchmarks.serve_load --draft /tmp/base/runs/code/final --threads 1 \
        --gammas 0,2,3,4,auto --concurrency 1,2,4,8,16 --requests-per-client 2 --max-tokens 32
    python -m benchmarks.serve_load --target Qwen/Qwen2.5-1.5B --draft Qwen/Qwen2.5-0.5B \
        --device cuda --dtype bfloat16

One server per `--gammas` value (0: the target alone, `--draft none`; N: N drafts per round;
auto: the per-row policy, `--gamma auto`), all started on 127.0.0.1 (free ports, loopback
only) with a traffic log and warmed up by one request each. Then, for each concurrency M,
every server is loaded in turn by M client threads (the official openai client, streaming)
that each send `--requests-per-client` HumanEval prompts one after another; `--repeats`
passes go round the servers, in a rotated order each pass, so that a drift of the machine's
speed is spread over all of them. Goodput is completion tokens / wall seconds, summed over a
cell's passes.

Printed: one row per concurrency with each server's goodput (tokens/s), auto's mean drafted
length and share of target-only row-rounds, and the ratios auto / best fixed γ and auto / no
draft (when those servers are in the run); the auto server's mean predicted vs realised
acceptance (its /metrics: how well the length policy's predictions are calibrated); then the
checks: failures (must be 0) and traffic records logged (must equal requests served) per
server. Exit status 1 when a check fails.
`--json PATH` also writes every cell; `--results` writes the table into its section of
benchmarks/RESULTS.md (benchmarks/results.py).
"""

import argparse
import json
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

from benchmarks import results as results_md
from specdistill.eval.cli_args import DEFAULT_MAX_GAMMA
from specdistill.eval.prompts import encode_prompts, load_prompts
from specdistill.formats.traffic_shards import read_traffic
from specdistill.serve.options import ServeOptions
from specdistill.serve.server import Server


@dataclass
class Cell:
    """One server at one concurrency, summed over the passes."""

    gamma: str
    clients: int
    requests: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    failures: list[str] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)  # rounds per drafted length, all requests

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else float("nan")

    def add_histogram(self, hist: list[int]) -> None:
        if len(self.drafted) < len(hist):
            self.drafted += [0] * (len(hist) - len(self.drafted))
        for k, n in enumerate(hist):
            self.drafted[k] += n


class Served:
    """One server of the run and its client."""

    def __init__(self, args, gamma: str):
        import openai

        self.gamma = gamma
        self.traffic = tempfile.mkdtemp(prefix=f"serve-load-{gamma}-")
        self.server = Server(
            ServeOptions(
                target=args.target,
                draft="none" if gamma == "0" else args.draft,
                gamma=None if gamma == "0" else gamma,
                max_gamma=args.max_gamma,
                max_num_seqs=args.max_batch,
                traffic=self.traffic,
                dtype=args.dtype,
                device=args.device,
                served_model_name="m",
            )
        )
        self.url = self.server.start("127.0.0.1", 0)
        self.client = openai.OpenAI(
            base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=600
        )
        self.served = 0

    def warm_up(self, prompt: list[int]) -> None:
        self.client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0)
        self.logged_before = len(read_traffic(self.traffic))

    def load(self, args, prompts: list[list[int]], cell: Cell, offset: int) -> None:
        """cell.clients threads, each sending args.requests_per_client requests in turn."""
        lock = threading.Lock()

        def client(i: int) -> None:
            for j in range(args.requests_per_client):
                n = offset + i * args.requests_per_client + j
                try:
                    stream = self.client.completions.create(
                        model="m",
                        prompt=prompts[n % len(prompts)],
                        max_tokens=args.max_tokens,
                        temperature=args.temperature,
                        seed=n,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                    tokens, spec = 0, None
                    for chunk in stream:
                        if chunk.usage is not None:
                            tokens = chunk.usage.completion_tokens
                            spec = ((chunk.model_extra or {}).get("metrics") or {}).get(
                                "speculative_decoding"
                            )
                    with lock:
                        cell.requests += 1
                        cell.tokens += tokens
                        self.served += 1
                        if spec:
                            cell.add_histogram(spec.get("drafted_length_histogram") or [])
                except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                    with lock:
                        cell.failures.append(repr(e))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(cell.clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cell.wall_s += time.perf_counter() - start

    def acceptance(self) -> tuple[float, float]:
        """The server's /metrics: mean predicted and realised acceptance of the drafts
        verification reached (NaN without predictions)."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics").text
        values = {f.name: f.samples[0].value for f in text_string_to_metric_families(text)}
        prefix = "specdistill:spec_decode_mean_"
        return values[prefix + "predicted_acceptance"], values[prefix + "realised_acceptance"]

    def logged(self) -> int:
        return len(read_traffic(self.traffic)) - self.logged_before


def ratio(a: float, b: float | None) -> str:
    return "-" if b is None or not b or b != b else f"{a / b:.2f}"


def table(
    cells: dict[tuple[str, int], Cell], gammas: list[str], concurrency: list[int]
) -> tuple[list[str], list[list[str]]]:
    """The printed table: one row per concurrency, each server's goodput (tokens/s), and for
    auto its mean drafted length, share of target-only row-rounds and ratios."""
    fixed = [g for g in gammas if g not in ("0", "auto")]
    names = {g: ("no draft" if g == "0" else f"γ={g}") for g in gammas}
    header = ["clients", *(names[g] for g in gammas)]
    if "auto" in gammas:
        header += ["auto mean γ", "auto target-only", "auto/best fixed", "auto/no draft"]
    rows = []
    for m in concurrency:
        row = [str(m)] + [f"{cells[g, m].tokens_per_s:.1f}" for g in gammas]
        if "auto" in gammas:
            auto = cells["auto", m]
            hist = auto.drafted
            rounds = sum(hist)
            mean = sum(k * n for k, n in enumerate(hist)) / rounds if rounds else float("nan")
            only = hist[0] / rounds if rounds else float("nan")
            best = max((cells[g, m].tokens_per_s for g in fixed), default=None)
            plain = cells["0", m].tokens_per_s if "0" in gammas else None
            best_name = max(fixed, key=lambda g: cells[g, m].tokens_per_s) if fixed else None
            row += [
                f"{mean:.2f}",
                f"{only:.0%}",
                ratio(auto.tokens_per_s, best) + (f" (γ={best_name})" if best_name else ""),
                ratio(auto.tokens_per_s, plain),
            ]
        rows.append(row)
    return header, rows


def results_section(setting: str, header: list[str], rows: list[list[str]]) -> results_md.Section:
    """This run's section of RESULTS.md: the setting and the table `main` prints."""
    return results_md.Section(
        key="serve_load",
        title="`specdistill serve` goodput under load",
        body=f"{setting}\n\n{results_md.markdown_table(header, rows)}\n",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="embedded:code-deep")
    parser.add_argument("--draft", default="embedded:code-deep-draft")
    parser.add_argument("--prompts", default="benchmarks/prompts/HumanEval.jsonl.gz")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument(
        "--gammas", default="0,2,3,4,auto", help="servers: 0 (no draft), N drafts per round, auto"
    )
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="concurrent clients (M)")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="passes round the servers")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--max-gamma", type=int, default=DEFAULT_MAX_GAMMA, help="auto's longest draft"
    )
    parser.add_argument("--max-batch", type=int, default=16, help="each server's rows")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--json", default=None, help="also write the cells here")
    results_md.add_argument(parser)
    return parser


def parse_arguments(argv) -> tuple[argparse.Namespace, list[str]]:
    """(the arguments, `args.concurrency` a list of ints; the servers' γ in order), a
    usage error for a γ or a count out of range."""
    parser = build_parser()
    args = parser.parse_args(argv)
    gammas = [g.strip() for g in args.gammas.split(",") if g.strip()]
    for g in gammas:
        if g != "auto" and not (g.isdigit() and int(g) >= 0):
            parser.error(f"--gammas: {g!r} is neither 'auto' nor an integer >= 0")
    if len(set(gammas)) != len(gammas):
        parser.error("--gammas names a value twice")
    args.concurrency = [int(m) for m in args.concurrency.split(",")]
    if min(args.concurrency) < 1 or args.requests_per_client < 1 or args.repeats < 1:
        parser.error("--concurrency, --requests-per-client and --repeats must be >= 1")
    return args, gammas


def main(argv=None) -> int:
    args, gammas = parse_arguments(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from specdistill.models.hub import load_tokenizer

    tokenizer = load_tokenizer(args.target)
    prompts = encode_prompts(
        load_prompts(args.prompts, limit=args.num_prompts),
        tokenizer,
        max_tokens=args.max_prompt_tokens,
    )
    servers = {g: Served(args, g) for g in gammas}
    try:
        for s in servers.values():
            s.warm_up(prompts[0])
        cells = {(g, m): Cell(g, m) for g in gammas for m in args.concurrency}
        start = time.perf_counter()
        for m in args.concurrency:
            for p in range(args.repeats):
                order = gammas[p % len(gammas) :] + gammas[: p % len(gammas)]
                for g in order:
                    servers[g].load(args, prompts, cells[g, m], offset=p * 1000)
        total = time.perf_counter() - start
        calibration = servers["auto"].acceptance() if "auto" in servers else None
    finally:
        for s in servers.values():
            s.server.stop()
    setting = setting_line(args, total, calibration)
    header, rows = table(cells, gammas, args.concurrency)
    print(setting)
    print(results_md.markdown_table(header, rows))
    ok = checks_pass(servers, cells, args.concurrency)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(c) | {"tokens_per_s": c.tokens_per_s} for c in cells.values()], f)
    print("checks:", "ok" if ok else "FAILED")
    if args.results and ok:
        print(f"wrote {results_md.write(results_section(setting, header, rows), args.results)}")
    elif args.results:
        print(f"{args.results} not written: a check failed")
    return 0 if ok else 1


def setting_line(args, total: float, calibration: tuple[float, float] | None) -> str:
    """What the table measured, over `total` seconds loaded, and auto's calibration."""
    setting = (
        f"goodput (completion tokens/s): target {args.target}, draft {args.draft}, "
        f"{args.requests_per_client} requests per client x {args.repeats} pass(es), "
        f"max_tokens {args.max_tokens}, temperature {args.temperature}, max batch "
        f"{args.max_batch}, threads {args.threads or 'default'}; {total:.0f} s loaded."
    )
    if calibration is not None:
        predicted, realised = calibration
        setting += (
            f" auto: mean predicted acceptance {predicted:.3f} vs realised {realised:.3f} "
            "(the drafts verification reached; /metrics)."
        )
    return setting


def checks_pass(servers: dict, cells: dict, concurrency: list[int]) -> bool:
    """No failed request, and a traffic record per request served, on every server; each
    failed check printed."""
    ok = True
    for g, s in servers.items():
        failures = [f for m in concurrency for f in cells[g, m].failures]
        if failures:
            ok = False
            print(f"gamma {g}: {len(failures)} failures, e.g.:", *failures[:3], sep="\n    ")
        if s.logged() != s.served:
            ok = False
            print(f"gamma {g}: records logged {s.logged()} != requests served {s.served}")
    return ok


if __name__ == "__main__":
    sys.exit(main())
