"""Real, lossless speculative decoding of a prompt set: the `speculate` command line.

    specdistill speculate --target embedded:code-deep --draft runs/code/final \\
        --prompts benchmarks/prompts/spec_bench_questions.jsonl --gamma 1,2,4,8,auto \\
        --temperature 0,1 --batch-size 1 --max-new-tokens 128 --out runs/spec

    specdistill speculate --target Qwen/Qwen2.5-7B-Instruct --draft runs/draft/final \\
        --prompts benchmarks/prompts/HumanEval.jsonl.gz --gamma 2,4,6 --adaptive \\
        --temperature 0.7 --top-p 0.95 --batch-size 8 --device cuda --dtype bfloat16 --out runs/spec

Per temperature, the target alone decodes every prompt (the baseline), then draft + target
at each γ (and adaptive γ; "auto": each row's own draft length per round,
eval/length_policy.py) (eval/sweep.py). The CLI writes DIR/report.json, DIR/report.md,
DIR/outputs.jsonl and PNG plots (eval/report.py); it shows a line per decoding run with an
ETA as it goes, and ends with a one-screen summary (eval/report_console.py).

Algorithm (docs/theory.md §2; eval/engine.py, eval/verify.py): per round the draft proposes
d_1..d_γ on its own KV cache, the target scores them in one forward pass, and speculative
sampling keeps each d_i with probability min(1, p_i(d_i)/q_i(d_i)), drawing a correction
from the residual at the first rejection or a bonus token when all γ are kept. Greedy
(temperature 0) keeps d_i while it is the target's argmax.

Temperature, top-k and top-p make the target's distribution p; the draft samples from its
unfiltered q at the same temperature (docs/theory.md §1). The output is distributed exactly
as sampling from the processed target. Rows accept independently (per-row KV rollback) and
finished rows give their place to waiting prompts (continuous batching, models/kv_cache.py).
"""

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from specdistill import threads
from specdistill.errors import UserError, run_guarded
from specdistill.eval.cli_args import DEFAULT_MAX_GAMMA, parse_gamma, resolve_device
from specdistill.eval.cli_args import at_least as _at_least
from specdistill.eval.cli_args import seed as _seed
from specdistill.eval.cli_args import top_p as _top_p
from specdistill.eval.outdir import claimed_output_dir
from specdistill.models import target_spec
from specdistill.progress import WorkProgress, usable_cores
from specdistill.verb_parser import quiet_third_party, temperatures, verb_parser


def _gammas(text: str) -> list[int | str]:
    """argparse type: comma-separated integers >= 1 or "auto", at least one (γ values, each
    read by `eval.cli_args.parse_gamma`)."""
    try:
        values = [parse_gamma(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(
            f'needs at least one integer >= 1 or "auto", comma-separated; got {text!r}'
        )
    return values


def within_context(target, prompt_ids: list[list[int]], max_new_tokens: int) -> int:
    """`max_new_tokens`, lowered with a note on stderr so that the longest prompt and its
    answer fit the target's context (its config's `max_position_embeddings`; unbounded when
    the config names none). UserError when the longest prompt alone fills the context."""
    context = getattr(target.config, "max_position_embeddings", None)
    if not context:
        return max_new_tokens
    longest = max(map(len, prompt_ids))
    room = context - longest
    if room < 1:
        raise UserError(
            f"the longest prompt has {longest} tokens and the target's context is {context} "
            f"positions (max_position_embeddings): give --max-prompt-tokens below {context}"
        )
    if max_new_tokens > room:
        print(
            f"[speculate] --max-new-tokens {max_new_tokens} lowered to {room}: the target's "
            f"context is {context} positions (max_position_embeddings) and the longest prompt "
            f"has {longest} tokens",
            file=sys.stderr,
        )
        return room
    return max_new_tokens


def _check_out_dir(out: str) -> str | None:
    """Why `out` cannot take the report, or None if it can.

    It must be a directory, or creatable in its nearest existing parent; writability is
    tested with a probe file in that directory, removed again. Nothing is created.
    """
    path = Path(out)
    if path.exists() and not path.is_dir():
        return f"{out} exists and is not a directory"
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        return f"{out} is not a writable directory ({e.strerror or e})"
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = verb_parser("speculate", __doc__)
    positive = _at_least(1)
    parser.add_argument(
        "--target", required=True, help="HF id, local dir, embedded:<name> or registry:<name>"
    )
    parser.add_argument(
        "--target-adapter", default=None, help="peft LoRA adapter dir on --target (not merged)"
    )
    parser.add_argument(
        "--draft", required=True, help="HF id, local dir, embedded:<name> or registry:<name>"
    )
    parser.add_argument("--prompts", required=True, help=".txt (one per line), .jsonl/.json(.gz)")
    parser.add_argument(
        "--out",
        required=True,
        help="output directory (created; checked writable before decoding; refused if it "
        "holds files, unless --overwrite)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the reports in a used --out"
    )
    parser.add_argument(
        "--gamma",
        type=_gammas,
        default="1,2,4,8",
        help='comma-separated γ values; each >= 1, or "auto" (per-row draft lengths from the '
        "drafts' predicted acceptance and the measured round costs)",
    )
    parser.add_argument(
        "--max-gamma",
        type=positive,
        default=DEFAULT_MAX_GAMMA,
        help='most drafts per row and round for "auto"',
    )
    parser.add_argument(
        "--adaptive", action="store_true", help="add an adaptive-γ run in [min γ, max γ]"
    )
    parser.add_argument(
        "--temperature", type=temperatures, default="0", help="comma-separated, >= 0; 0 = greedy"
    )
    parser.add_argument(
        "--top-p", type=_top_p, default=None, help="in (0, 1], filters the target; 1 = off"
    )
    parser.add_argument(
        "--top-k", type=_at_least(0), default=0, help=">= 0, filters the target; 0 = off"
    )
    parser.add_argument(
        "--batch-size", type=positive, default=1, help="requests decoded together; >= 1"
    )
    parser.add_argument("--max-new-tokens", type=positive, default=128, help=">= 1")
    parser.add_argument(
        "--max-prompt-tokens", type=positive, default=1024, help="keep the last N prompt tokens"
    )
    parser.add_argument(
        "--num-prompts", type=positive, default=None, help="use the first N prompts"
    )
    parser.add_argument("--stop-at-eos", action="store_true", help="end requests at EOS")
    parser.add_argument("--seed", type=_seed, default=0, help="sampling seed, in [0, 2**63 - 1]")
    parser.add_argument(
        "--repeats",
        type=positive,
        default=1,
        help="runs of every configuration, round-robin; the fastest counts (stable timings)",
    )
    parser.add_argument("--device", default="auto", help="cuda, cpu, ...; auto: cuda if present")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the models' dtype",
    )
    _engine_arguments(parser)
    threads.add_argument(parser)
    return parser


def _engine_arguments(parser) -> None:
    """--engine and its vLLM option."""
    parser.add_argument(
        "--engine",
        default="specdistill",
        choices=["specdistill", "vllm"],
        help="vllm: also decode the prompts in vLLM with the draft's vLLM export, and report "
        "both engines side by side (eval/vllm_compare.py; fixed γ only)",
    )
    parser.add_argument(
        "--vllm-compile",
        action="store_true",
        help="with --engine vllm: let vLLM compile the models (a slower start, faster decoding)",
    )


def main(argv: Sequence[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    from specdistill.eval.prompts import load_prompts  # lazy: --help loads no torch

    # A bad prompt file or --out fails now, not after the models have loaded and decoded.
    prompts = load_prompts(args.prompts, limit=args.num_prompts)
    if args.engine == "vllm":
        from specdistill.eval.vllm_engine import check_installed  # lazy: --help loads no torch

        check_installed("speculate --engine vllm")
        if any(not isinstance(g, int) for g in args.gamma) or args.adaptive:
            parser.error(
                '--engine vllm compares fixed γ: give --gamma numbers, no "auto" or --adaptive'
            )
    if problem := _check_out_dir(args.out):
        parser.error(f"--out: {problem}")
    with claimed_output_dir(args.out, overwrite=args.overwrite):
        return _run(args, prompts)


def _run(args, prompts) -> dict:
    """Load the models, decode, write the report into the claimed `args.out`."""
    import torch  # lazy: --help loads no torch

    from specdistill import drafts  # lazy: --help loads no torch
    from specdistill.drafts.loader import load_draft  # lazy: --help loads no torch
    from specdistill.eval import report, sweep, vllm_compare  # lazy: --help loads no torch
    from specdistill.eval.prompts import encode_prompts  # lazy: --help loads no torch
    from specdistill.eval.report_console import console_summary  # lazy: --help loads no torch

    # lazy: --help loads no torch
    from specdistill.models.hub import check_tokenizers, load_tokenizer

    quiet_third_party()
    args.device = resolve_device(args.device)
    spec = target_spec.TargetSpec.from_args(args)
    tokenizer = target_spec.load_tokenizer(spec)  # first: the draft is checked against it
    draft = load_draft(args.draft, dtype=args.dtype)
    kind = drafts.type_of(draft)
    if args.engine == "vllm":  # a draft vLLM cannot decode is refused before the sweep
        vllm_compare.speculation_of(draft)
    if kind.own_tokenizer:
        check_tokenizers(tokenizer, load_tokenizer(args.draft), args.target, args.draft)
    elif kind.vocab_size_of(draft) > len(tokenizer):
        raise ValueError(
            f"the {kind.name} draft {args.draft} covers {kind.vocab_size_of(draft)} token ids; "
            f"the target's tokenizer has {len(tokenizer)}: it was trained for another target"
        )
    target, tokenizer = target_spec.load_target_and_tokenizer(spec, tokenizer=tokenizer)
    threads.start(args.threads)  # once the models load: an error stays one line
    target.to(args.device)
    draft.to(args.device)
    prompt_ids = encode_prompts(prompts, tokenizer, max_tokens=args.max_prompt_tokens)
    max_new_tokens = within_context(target, prompt_ids, args.max_new_tokens)
    settings = sweep.Settings(
        gammas=args.gamma,
        adaptive=args.adaptive,
        temperatures=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k or None,  # 0 is off
        batch_size=args.batch_size,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id if args.stop_at_eos else None,
        seed=args.seed,
        repeats=args.repeats,
        max_gamma=args.max_gamma,
    )
    with WorkProgress("runs", sweep.work_units(settings), prefix="[speculate] ") as progress:
        result, runs = sweep.sweep(target, draft, prompt_ids, settings, progress)
    result["meta"] = {
        "target": args.target,
        "target_adapter": args.target_adapter,
        "draft": args.draft,
        "prompts": args.prompts,
        "n_prompts": len(prompts),
        "device": args.device,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "cores": usable_cores(),
        "busy_load_average": progress.busiest and progress.busiest.load1,
    }
    if args.engine == "vllm":
        result["vllm"] = _vllm_entries(args, draft, prompt_ids, result, runs, settings)
    report.write(result, runs, prompts, tokenizer, args.out)
    print(console_summary(result, args.out))
    return result


def _vllm_entries(args, draft, prompt_ids, result, runs, settings) -> list[dict]:
    """The sweep's fixed-γ configurations decoded again by vLLM (eval/vllm_compare.py)."""
    from specdistill.eval import vllm_compare  # lazy: --help loads no torch

    run = vllm_compare.VllmRunSettings(
        dtype=args.dtype,
        compile=args.vllm_compile,
        batch_size=args.batch_size,
        threads=args.threads,
        seed=args.seed,
        max_new_tokens=settings.max_new_tokens,
        eos_token_id=settings.eos_token_id,
    )
    entries = vllm_compare.compare(args.target, draft, args.draft, prompt_ids, result, runs, run)
    return [e.model_dump() for e in entries]


if __name__ == "__main__":
    sys.exit(run_guarded(main, sys.argv[1:]))
