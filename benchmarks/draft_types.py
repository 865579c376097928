r"""Standalone draft vs EAGLE-3 head, each trained with each loss for equal steps, then run
through real speculative decoding on the same prompts.

    python -m benchmarks.draft_types                              # embedded target, 4 runs
    python -m benchmarks.draft_types --losses lk_lambda,fkl --steps 300 --gammas 3,5 \
        --temperatures 0,1 --prompts benchmarks/prompts/HumanEval.jsonl.gz --num-prompts 40

Standalone runs use recipes/code-4layer.yaml (the pretrained 1-layer embedded draft), head runs
recipes/code-eagle3.yaml (a fresh head on the same target), parallel runs
recipes/code-parallel.yaml; all get the same data, batch, steps and loss. `--recipe KIND=FILE`
picks another recipe for a kind; every kind's recipe must name the same target. The parallel
draft against the standalone one on the embedded default, both continuing the first command's
draft for the same steps (docs/parallel.md):

    python -m benchmarks.draft_types --kinds standalone,parallel --recipe standalone=code.yaml \
        --losses lk_lambda --steps 60 --gammas 2,3,4,5,6 --temperatures 0,1 --num-prompts 16 \
        --threads 1 --out runs/parallel_bench draft.model=runs/code/final \
        acceptance_head.enabled=false

`--set KIND:KEY=VALUE` overrides one kind's recipe only. All three kinds on the embedded
default, the EAGLE-3 head fresh on the same target:

    python -m benchmarks.draft_types --kinds standalone,eagle3,parallel \
        --recipe standalone=code.yaml --losses lk_lambda --steps 100 --gammas 2,3,4,6 \
        --set standalone:draft.model=runs/code/final --set parallel:draft.model=runs/code/final \
        target.model=embedded:code-deep acceptance_head.enabled=false

Each trained draft then decodes the prompts in the engine's evaluation sweep
(eval/sweep.py: greedy and sampled, per γ) against target-only decoding measured in the same
run.
Prints measured τ, speedup, engine efficiency and offline α per configuration, and writes
everything to OUT/summary.json. Already trained runs in OUT are reused (--retrain to redo).
`--results` writes the table into its section of benchmarks/RESULTS.md (benchmarks/results.py).
"""

import argparse
import json
from pathlib import Path

import torch
from accelerate.state import AcceleratorState, GradientState

from benchmarks import results as results_md
from specdistill.drafts.loader import load_draft
from specdistill.eval.prompts import encode_prompts, load_prompts
from specdistill.eval.sweep import Settings, sweep
from specdistill.models.hub import load_model, load_tokenizer
from specdistill.train.config import load_recipe
from specdistill.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
RECIPES = {  # one target (the parallel draft's recipe is on embedded:code-deep: --recipe)
    "standalone": "code-4layer.yaml",
    "eagle3": "code-eagle3.yaml",
    "parallel": "code-parallel.yaml",
}


def kind_overrides(picks: list[str], kinds: list[str]) -> dict[str, list[str]]:
    """`--set KIND:KEY=VALUE` picks as each kind's own recipe overrides; an unknown kind or a
    pick without a KEY=VALUE is refused by name."""
    per_kind: dict[str, list[str]] = {kind: [] for kind in kinds}
    for pick in picks:
        kind, sep, override = pick.partition(":")
        if not sep or "=" not in override:
            raise SystemExit(f"--set {pick!r}: expected KIND:KEY=VALUE")
        if kind not in per_kind:
            raise SystemExit(f"--set {pick!r}: {kind!r} is not one of --kinds {kinds}")
        per_kind[kind].append(override)
    return per_kind


def train(kind: str, loss: str, steps: int, out: Path, overrides: list[str], retrain: bool):
    """Train one (kind, loss) run in OUT, or reuse a finished one."""
    run_dir = out / f"{kind}-{loss}"
    if (run_dir / "eval.json").is_file() and not retrain:
        return run_dir, json.loads((run_dir / "eval.json").read_text())
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    recipe = load_recipe(
        REPO / "recipes" / RECIPES[kind],
        [
            *overrides,
            f"loss.name={loss}",
            f"train.max_steps={steps}",
            f"train.output_dir={run_dir}",
            "train.save_every=0",
            "eval.every=0",
        ],
    )
    return run_dir, Trainer.from_recipe(recipe).run()


HEADER = [
    "draft",
    "loss",
    "trainable params",
    "held-out α (T=1)",
    "config",
    "α per depth",
    "τ",
    "τ pred",
    "c",
    "draft share",
    "speedup",
    "efficiency",
    "tok/s",
    "target tok/s",
    "speedup, pooled target",
]


def pooled_target(rows: list[tuple]) -> dict[str, float]:
    """Per temperature, the fastest of the target-only tokens/s this run measured (one per
    draft's sweep, the least disturbed by other load): a baseline common to all kinds, so
    that a load spike during one kind's own target-only measurement does not inflate that
    kind's speedup (it can only understate speedups)."""
    by_t: dict[str, list[float]] = {}
    for *_, c in rows:
        by_t.setdefault(c["name"].split()[0], []).append(c["target_tokens_per_s"])
    return {t: max(v) for t, v in by_t.items()}


def table(rows: list[tuple]) -> list[list[str]]:
    """The cells of HEADER: one row per (kind, loss, trainable params, held-out α, sweep
    config), the config as eval/sweep.py reports it."""
    cells = []
    pooled = pooled_target(rows)
    for kind, loss, params, alpha, c in rows:
        depth = c.get("alpha_offline_depth")
        per_depth = " ".join(f"{a:.2f}" for a in depth) if depth else f"{c['alpha_offline']:.2f}"
        cells.append(
            [
                kind,
                loss,
                f"{params / 1e6:.2f}M",
                f"{alpha:.3f}",
                c["name"],
                per_depth,
                f"{c['tau']:.2f}",
                f"{c['tau_pred']:.2f}",
                f"{c['cost_ratio_c']:.3f}",
                f"{c['draft_time_share']:.2f}",
                f"{c['speedup']:.2f}",
                f"{c['engine_efficiency']:.2f}",
                f"{c['tokens_per_s']:.1f}",
                f"{c['target_tokens_per_s']:.1f}",
                f"{c['tokens_per_s'] / pooled[c['name'].split()[0]]:.2f}",
            ]
        )
    return cells


def results_section(setting: str, target: str, cells: list[list[str]]) -> results_md.Section:
    """This run's section of RESULTS.md: the target, the setting and the table `main` prints."""
    body = f"Target `{target}`; {setting}.\n\n{results_md.markdown_table(HEADER, cells)}\n"
    return results_md.Section(key="draft_types", title="Draft types at equal steps", body=body)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kinds", default="standalone,eagle3")
    parser.add_argument(
        "--recipe", action="append", default=[], help="KIND=FILE in recipes/, per kind"
    )
    parser.add_argument("--losses", default="lk_lambda,fkl")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--gammas", default="3,5")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--prompts", default=str(REPO / "benchmarks/prompts/HumanEval.jsonl.gz"))
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--retrain", action="store_true")
    parser.add_argument("--out", default="runs/draft_types")
    results_md.add_argument(parser)
    parser.add_argument(
        "--set", action="append", default=[], help="KIND:KEY=VALUE, a recipe override for one kind"
    )
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every run")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    out = Path(args.out)
    kinds, names = args.kinds.split(","), args.losses.split(",")
    for pick in args.recipe:
        kind, _, name = pick.partition("=")
        RECIPES[kind] = name

    per_kind = kind_overrides(args.set, kinds)
    target_name = shared_target(kinds, args.overrides, per_kind)
    trained = {}
    for kind in kinds:
        overrides = [*args.overrides, *per_kind[kind]]
        for loss in names:
            trained[kind, loss] = train(kind, loss, args.steps, out, overrides, args.retrain)

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(target_name)
    target = load_model(target_name)
    prompts = load_prompts(args.prompts, limit=args.num_prompts)
    prompt_ids = encode_prompts(prompts, tokenizer, max_tokens=256)
    settings = Settings(
        gammas=[int(g) for g in args.gammas.split(",")],
        temperatures=tuple(float(t) for t in args.temperatures.split(",")),
        max_new_tokens=args.max_new_tokens,
    )
    rows, summary = evaluate(trained, target, prompt_ids, settings)
    setting = (
        f"{args.steps} steps each; {len(prompt_ids)} prompts from {Path(args.prompts).name}, "
        f"{args.max_new_tokens} new tokens; speedup = tokens/s ÷ target-only tokens/s "
        "measured in the same run"
    )
    cells = table(rows)
    print(f"\n{setting}")
    print(results_md.markdown_table(HEADER, cells))
    if args.results:
        section = results_section(setting, target_name, cells)
        print(f"wrote {results_md.write(section, args.results)}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))


def shared_target(kinds: list[str], overrides: list[str], per_kind: dict[str, list[str]]) -> str:
    """The target model every kind's recipe names; SystemExit when they differ."""
    targets = {
        kind: load_recipe(
            REPO / "recipes" / RECIPES[kind], [*overrides, *per_kind[kind]]
        ).target.model
        for kind in kinds
    }
    if len(set(targets.values())) != 1:
        raise SystemExit(f"the kinds' recipes name different targets {targets}: override one")
    return targets[kinds[0]]


def evaluate(trained: dict, target, prompt_ids: list[list[int]], settings: Settings):
    """Sweep each trained draft: (the table's rows, summary.json's content)."""
    rows, summary = [], {}
    for (kind, loss), (run_dir, result) in trained.items():
        draft = load_draft(str(run_dir / "final"))
        params = result.get("trainable_params") or sum(p.numel() for p in draft.parameters())
        evaluation, _ = sweep(target, draft, prompt_ids, settings)
        summary[f"{kind}-{loss}"] = {
            "trainable_params": params,
            "train_eval": {k: result[k] for k in ("alpha", "alpha_greedy", "steps")},
            "configs": evaluation["configs"],
        }
        for c in evaluation["configs"]:
            rows.append((kind, loss, params, result["alpha"], c))
    return rows, summary


if __name__ == "__main__":
    main()
