"""`specdistill drift`: the draft's α drift after a target fine-tune, and a deploy gate.

    specdistill drift --draft runs/code-4layer/final --target-before embedded:code \\
        --target-after embedded:code --adapter-after runs/ft/adapter \\
        --prompts benchmarks/prompts/spec_bench_questions.jsonl --out runs/drift

    # CI: exit status 1 when the drop's lower bound passes 0.02 at T = 0 or T = 1
    specdistill drift --draft D --target-before A --target-after A --adapter-after B \\
        --prompts p.jsonl --out runs/gate --temperature 0,1 --fail-if-drop-above 0.02

    # the same, judged at the traffic's mixture (20% greedy tokens, 80% at T = 1) ...
    specdistill drift ... --temperature-mix 0:0.2,1:0.8 --fail-if-drop-above 0.02
    # ... or at the mixture `specdistill serve --traffic` logged
    specdistill drift ... --traffic logs/traffic --fail-if-drop-above 0.02

A target is a model directory, a hub id, `embedded:<name>`, or a base plus a peft LoRA
adapter (`--adapter-before` / `--adapter-after`), loaded unmerged (`models.hub.load_target`).

What is measured (docs/theory.md §1). Each target generates a response to every prompt (the
project's engine, greedy at --temperature 0, else sampled). On its own responses each
target is compared with the draft, teacher-forced: α = Σ min(p, q) at the serving
temperature and α at T = 0 (argmax agreement), per position (per drafting depth for an
EAGLE-3 head, chained into τ by `eval.stats.tau_chain`).

- alpha_before: draft vs the before-target on the before-target's responses (what the draft
  was measured on when it was fit); alpha_after: draft vs the after-target on the
  after-target's responses (what the draft sees in serving after the fine-tune).
- The drop splits in two, both on the after-target's text: alpha_before_on_after_text is the
  draft vs the *before*-target there. alpha_before − alpha_before_on_after_text is the part
  due to the text moving (new prompts' answers look different), alpha_before_on_after_text −
  alpha_after the part due to the target's conditional distribution moving under the draft.
- target_tv: mean ½Σ|p_before − p_after| between the two targets on the after-target's
  responses, at the serving temperature (T = 1 when serving is greedy); and
  target_argmax_disagreement. α_after ≥ α_before_on_after_text − TV (triangle inequality),
  so the TV bounds how much acceptance the fine-tune alone can remove.
- Intervals: a paired bootstrap over prompts (each prompt's before and after responses are a
  pair), resampling prompts and taking ratios of sums (α over positions). Per category
  (a prompt record's `category`) the same, for categories with at least --min-samples prompts;
  smaller cells are reported as insufficient.
- top_tokens: on the after-target's responses, Σ over positions of (α_before − α_after)
  grouped by the after-target's argmax token (divided by the number of positions, so the
  entries sum to the conditional part of the drop): which tokens lose the acceptance mass.
- verdict: refit recommended when the whole interval of the drop of α (serving temperature)
  lies above --threshold (advice in the report; the exit status is the gate's, below).

The gate (eval/drift_gate.py). Each temperature of --temperature (or of the mixture) is
measured on the same prompts. With --fail-if-drop-above X the command exits with status 1
when the lower bound of the drop's interval lies above X at any served temperature, or, with a
mixture, for the mixture's drop Σ w_T · drop_T (one paired bootstrap over prompts for all
temperatures); with --fail-if-tau-drop-above F, when the lower bound of the relative drop of
predicted τ at --tau-gamma (1 − τ_after / τ_before, from the same draws) lies above F; else
0. Errors in the input exit 2. DIR/gate.json (`GateReport`) holds every check. The mixture
is --temperature-mix, or --traffic DIR: the share of completion tokens at each temperature
in the traffic log (formats/traffic_shards.py; `convert-traffic` writes one
from vLLM or SGLang), each distinct temperature measured once. The measurement is
eval/drift.py.

Writes DIR/report.json, DIR/report.md, DIR/drift.png and DIR/responses_after.jsonl (the
after-target's responses as training records: `data.train` of a repair run, recipes/repair.yaml)
and DIR/gate.json; with several temperatures the four reports go to DIR/T<t>/ (DIR/T0/,
DIR/T1/). DIR must be new or empty unless --overwrite; the prompt file is read and checked
first, and a run that fails before writing removes the DIR it created.
"""

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from specdistill import threads
from specdistill.bounds import (
    MAX_BATCH,
    MAX_BOOTSTRAP,
    MAX_CONTEXT,
    MAX_GAMMA,
    MAX_PROMPTS,
    context_limit,
    float_in,
    int_in,
)
from specdistill.errors import UserError, run_guarded
from specdistill.eval.cli_args import DEFAULT_MAX_GAMMA, resolve_device
from specdistill.eval.cli_args import at_least as _at_least
from specdistill.eval.cli_args import seed as _seed
from specdistill.eval.cli_args import top_p as _top_p
from specdistill.eval.outdir import claimed_output_dir
from specdistill.models import target_spec
from specdistill.verb_parser import quiet_third_party, temperatures, verb_parser

if TYPE_CHECKING:
    # lazy: for the type hints; drift_gate loads numpy and torch (imported when run)
    from specdistill.eval.drift_gate import GateReport


def _mix(text: str) -> dict[float, float]:
    from specdistill.eval.drift_gate import parse_mix  # lazy: --help loads no torch

    try:
        return parse_mix(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = verb_parser("drift", __doc__)
    _add_inputs(parser)
    _add_served_sampling(parser)
    _add_generation(parser)
    _add_statistics(parser)
    parser.add_argument(
        "--seed", type=_seed, default=0, help="sampling and bootstrap seed, in [0, 2**63 - 1]"
    )
    parser.add_argument("--device", default="auto", help="cuda, cpu, ...; auto: cuda if present")
    threads.add_argument(parser)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the models' dtype",
    )
    return parser


def _add_inputs(parser: argparse.ArgumentParser) -> None:
    """The draft, the two targets, the prompts and the output directory."""
    parser.add_argument("--draft", required=True, help="the draft (standalone or EAGLE-3 dir)")
    parser.add_argument(
        "--target-before",
        required=True,
        help="HF id, local dir, embedded:<name> or registry:<name>",
    )
    parser.add_argument(
        "--target-after", required=True, help="HF id, local dir, embedded:<name> or registry:<name>"
    )
    parser.add_argument(
        "--adapter-before", default=None, help="peft adapter dir on --target-before"
    )
    parser.add_argument("--adapter-after", default=None, help="peft adapter dir on --target-after")
    parser.add_argument(
        "--prompts", required=True, help=".txt, .jsonl/.json(.gz) (eval/prompts.py)"
    )
    parser.add_argument(
        "--out",
        required=True,
        help="output directory (created; refused if it holds files, unless --overwrite)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the reports in a used --out"
    )


def _add_served_sampling(parser: argparse.ArgumentParser) -> None:
    """The served temperatures (a list, a mixture or a traffic log's) and the gate."""
    served = parser.add_mutually_exclusive_group()
    served.add_argument(
        "--temperature",
        type=temperatures,
        default="1",
        help="serving temperatures, comma-separated (0 = greedy): responses are sampled at "
        "each and the gate judges each",
    )
    served.add_argument(
        "--temperature-mix",
        type=_mix,
        default=None,
        metavar="T:W,...",
        help="the traffic's share per temperature (e.g. 0:0.2,1:0.8, normalised): each "
        "temperature is measured and the gate judges the mixture",
    )
    served.add_argument(
        "--traffic",
        default=None,
        metavar="DIR",
        help="a traffic log (specdistill serve --traffic): its completion tokens' share per "
        "temperature is the mixture the gate judges",
    )
    parser.add_argument(
        "--fail-if-drop-above",
        type=float_in(0.0, 1.0),
        default=None,
        metavar="X",
        help="exit 1 when the lower bound of the drop of α lies above X (the gate); without "
        "it (or --fail-if-tau-drop-above) the command reports and exits 0",
    )
    parser.add_argument(
        "--fail-if-tau-drop-above",
        type=float_in(0.0, 1.0),
        default=None,
        metavar="F",
        help="exit 1 when the lower bound of the relative drop of predicted τ at --tau-gamma "
        "lies above F (0.02: τ known to fall by more than 2%%)",
    )
    parser.add_argument(
        "--tau-gamma",
        type=int_in(1, MAX_GAMMA),
        default=5,
        help=f"the γ you serve, for the τ gate, in [1, {MAX_GAMMA}]",
    )


def _add_generation(parser: argparse.ArgumentParser) -> None:
    """How the targets' responses are generated and the draft scored on them."""
    parser.add_argument(
        "--top-p", type=_top_p, default=None, help="in (0, 1], filters both targets; 1 = off"
    )
    parser.add_argument(
        "--top-k", type=_at_least(0), default=0, help=">= 0, filters both targets; 0 = off"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int_in(1, MAX_CONTEXT),
        default=64,
        help="tokens per response, at most the targets' context (max_position_embeddings)",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=int_in(1, MAX_CONTEXT),
        default=512,
        help="keep the last N prompt tokens",
    )
    parser.add_argument(
        "--num-prompts",
        type=int_in(1, MAX_PROMPTS),
        default=64,
        help=f"use the first N prompts, in [1, {MAX_PROMPTS}]",
    )
    parser.add_argument(
        "--no-stop-at-eos", action="store_true", help="generate --max-new-tokens past EOS"
    )
    parser.add_argument(
        "--batch-size", type=int_in(1, MAX_BATCH), default=8, help="responses generated together"
    )
    parser.add_argument(
        "--depth",
        type=int_in(1, MAX_GAMMA),
        default=None,
        help=f"EAGLE-3 / parallel positions, in [1, {MAX_GAMMA}] (default: ttt_steps)",
    )


def _add_statistics(parser: argparse.ArgumentParser) -> None:
    """The report's verdict, its cells, intervals and predicted τ."""
    parser.add_argument(
        "--threshold",
        type=float_in(0.0, 1.0),
        default=0.02,
        help="the report's verdict: refit when the drop's interval lies entirely above this",
    )
    parser.add_argument(
        "--min-samples", type=int_in(1), default=10, help="prompts per category cell, >= 1"
    )
    parser.add_argument(
        "--bootstrap",
        type=int_in(1, MAX_BOOTSTRAP),
        default=1000,
        help=f"bootstrap resamples of the prompts, in [1, {MAX_BOOTSTRAP}]",
    )
    parser.add_argument(
        "--confidence", type=float, default=0.95, help="the intervals' confidence, in (0, 1)"
    )
    parser.add_argument(
        "--max-gamma",
        type=int_in(1, MAX_GAMMA),
        default=DEFAULT_MAX_GAMMA,
        help=f"predicted τ up to this γ, in [1, {MAX_GAMMA}]",
    )


@dataclass
class DriftRun:
    """What one `specdistill drift` measured: a report per temperature and the gate."""

    reports: dict[float, dict] = field(default_factory=dict)
    gate: "GateReport | None" = None


def run(argv: Sequence[str] | None = None) -> DriftRun:
    """Parse, measure every temperature, write DIR, print the reports and the gate."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 < args.confidence < 1:
        parser.error(f"--confidence must be in (0, 1); got {args.confidence}")
    if args.traffic is not None:
        args.temperature_mix = temperature_mix(args.traffic)
    if args.temperature_mix is not None:
        args.temperature_mix = greedy_merged(args.temperature_mix)
        args.temperature = sorted(args.temperature_mix)
    else:  # a temperature below GREEDY_BELOW decodes greedily, as the server does
        args.temperature = sorted(greedy_merged(dict.fromkeys(args.temperature, 1.0)))

    from specdistill.eval.prompts import load_prompts  # lazy: --help loads no torch

    prompts = load_prompts(args.prompts, limit=args.num_prompts)
    with claimed_output_dir(args.out, overwrite=args.overwrite):
        return _run(args, prompts)


def temperature_mix(directory) -> dict[float, float]:
    """Each temperature's share of the completion tokens in a traffic log (the positions a
    draft drafts at), from the log's validated records (`read_records`)."""
    from specdistill.formats.traffic import TrafficError  # lazy: pydantic slows --help

    # lazy: only with --traffic; pydantic slows --help
    from specdistill.formats.traffic_shards import read_records, shards

    if not Path(directory).is_dir():
        raise TrafficError(f"--traffic {directory}: no such directory")
    for path in shards(directory):
        if not path.is_file():
            raise TrafficError(f"--traffic {directory}: {path.name} is not a regular file")
    try:
        records = read_records(directory)
    except RecursionError:
        raise TrafficError(f"--traffic {directory}: a record is nested too deeply") from None
    except OSError as e:
        raise TrafficError(
            f"--traffic {directory}: cannot read {e.filename}: {e.strerror}"
        ) from None
    tokens: dict[float, float] = {}
    for record in records:
        t = float(record.sampling.temperature)
        tokens[t] = tokens.get(t, 0) + len(record.completion_token_ids)
    total = sum(tokens.values())
    if not total:
        raise TrafficError(f"--traffic {directory}: no completion tokens in its records")
    return greedy_merged({t: n / total for t, n in sorted(tokens.items()) if n})


def greedy_merged(mix: dict[float, float]) -> dict[float, float]:
    """`mix` (temperature -> weight) with every temperature below `GREEDY_BELOW` (1e-5) merged
    into 0: the server and the engine decode those greedily, so they are measured so."""
    from specdistill.eval.sampling import is_greedy  # lazy: --help loads no torch

    merged: dict[float, float] = {}
    for t, w in mix.items():
        key = 0.0 if is_greedy(t) else t
        merged[key] = merged.get(key, 0.0) + w
    return dict(sorted(merged.items()))


def main(argv: Sequence[str] | None = None) -> int:
    """`specdistill drift`: 1 when the gate fails, else 0 (input errors: 2, run_guarded)."""
    return 1 if run(argv).gate.failed else 0


def _run(args, prompts) -> DriftRun:
    """Load the models once, measure each temperature, write the reports and the gate."""
    import numpy as np  # lazy: --help loads no numpy

    from specdistill import drafts  # lazy: --help loads no torch
    from specdistill.drafts.loader import load_draft  # lazy: --help loads no torch
    from specdistill.eval import drift, drift_gate, drift_report  # lazy: --help loads no torch

    # lazy: --help loads no torch
    from specdistill.models.hub import check_tokenizers, load_tokenizer

    quiet_third_party()
    args.device = resolve_device(args.device)
    spec_before, spec_after = _target_specs(args)
    tokenizer = target_spec.load_tokenizer(spec_after)
    tokenizer_before = target_spec.load_tokenizer(spec_before)
    check_tokenizers(tokenizer_before, tokenizer, args.target_before, args.target_after)
    draft = load_draft(args.draft, dtype=args.dtype)
    _check_depth(args.depth, drafts.type_of(draft), draft)
    if drafts.type_of(draft).own_tokenizer:
        check_tokenizers(tokenizer, load_tokenizer(args.draft), args.target_after, args.draft)
    before, _ = target_spec.load_target_and_tokenizer(spec_before, tokenizer=tokenizer_before)
    after, tokenizer = target_spec.load_target_and_tokenizer(spec_after, tokenizer=tokenizer)
    for name, target in ((args.target_before, before), (args.target_after, after)):
        context = getattr(target.config, "max_position_embeddings", None)
        context_limit("--max-new-tokens", args.max_new_tokens, context, name)
    threads.start(args.threads)  # once the models load: errors stay one line
    for model in (before, after, draft):
        model.to(args.device)
    result, pairs = DriftRun(), {}
    several = len(args.temperature) > 1
    for temperature in args.temperature:
        report, responses, scores = drift.measure_scores(
            before,
            after,
            draft,
            tokenizer,
            prompts,
            temperature=temperature,
            top_p=args.top_p,
            top_k=args.top_k or None,  # 0 is off
            max_new_tokens=args.max_new_tokens,
            max_prompt_tokens=args.max_prompt_tokens,
            stop_at_eos=not args.no_stop_at_eos,
            batch_size=args.batch_size,
            depth=args.depth,
            seed=args.seed,
            threshold=args.threshold,
            min_samples=args.min_samples,
            bootstrap=args.bootstrap,
            confidence=args.confidence,
            max_gamma=args.max_gamma,
        )
        report["meta"] = _meta(args)
        out = Path(args.out) / f"T{temperature:g}" if several else Path(args.out)
        drift_report.write(report, out, prompts, responses, tokenizer)
        print(drift_report.markdown(report))
        result.reports[temperature] = report
        # α at the serving temperature (column 0) and the positions (column 2), per depth
        pairs[temperature] = tuple(
            np.stack([getattr(s, side) for s in scores])[:, :, [0, 2]]
            for side in ("before", "after")
        )
    result.gate = drift_gate.judge(
        pairs,
        threshold=args.fail_if_drop_above,
        tau_threshold=args.fail_if_tau_drop_above,
        tau_gamma=args.tau_gamma,
        weights=args.temperature_mix,
        samples=args.bootstrap,
        confidence=args.confidence,
        seed=args.seed,
    )
    (Path(args.out) / "gate.json").write_text(result.gate.model_dump_json(indent=2) + "\n")
    print(drift_gate.markdown(result.gate))
    return result


def _target_specs(args) -> tuple:
    """(before, after): the `models.target_spec.TargetSpec` of each target's flags."""
    return (
        target_spec.TargetSpec(args.target_before, args.adapter_before, dtype=args.dtype),
        target_spec.TargetSpec(args.target_after, args.adapter_after, dtype=args.dtype),
    )


def _check_depth(depth: int | None, kind, draft=None) -> None:
    """UserError when `--depth` asks for depths of a draft type whose α has none, or for
    more depths than the draft was trained at (an EAGLE-3 head's `ttt_steps`, a parallel
    draft's `parallel_depths`; unknown: not checked)."""
    if depth is not None and depth != 1 and not kind.per_depth_alpha:
        raise UserError(
            f"--depth {depth}: a {kind.name} draft's α does not depend on the drafting depth "
            "(it drafts from its own tokens); leave --depth unset for it"
        )
    config = getattr(draft, "config", None)
    trained = getattr(draft, "ttt_steps", None) or getattr(config, "parallel_depths", None)
    if depth is not None and isinstance(trained, int) and depth > trained:
        raise UserError(
            f"--depth {depth} is beyond the {trained} depths this {kind.name} draft was trained "
            f"at: set --depth in [1, {trained}], or leave it unset"
        )


def _meta(args) -> dict:
    return {
        "draft": args.draft,
        "target_before": args.target_before
        + (f" + {args.adapter_before}" if args.adapter_before else ""),
        "target_after": args.target_after
        + (f" + {args.adapter_after}" if args.adapter_after else ""),
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "device": args.device,
        "dtype": args.dtype,
    }


if __name__ == "__main__":
    sys.exit(run_guarded(main, sys.argv[1:]))
