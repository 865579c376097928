r"""Distil the same draft with each loss at equal steps and compare held-out acceptance.

    python benchmarks/loss_compare.py                       # embedded pair, recipes/code.yaml
    python benchmarks/loss_compare.py --losses fkl,tv --seeds 0,1,2 --steps 300
    python benchmarks/loss_compare.py --on-policy 0.5 --steps 300        # both levers
    python benchmarks/loss_compare.py --target Qwen/Qwen2.5-7B-Instruct \
        --draft Qwen/Qwen2.5-0.5B-Instruct --data chats.jsonl --steps 500   # your own pair

`tau` is the accepted-length objective on the draft's own chains (docs/theory.md), trained at
the γ of the τ columns (`--gamma`) when measured τ is on.

Each run starts from the same pretrained draft; only the loss (and, across seeds, the order
of training sequences) changes. With `--on-policy F`, every loss also runs with
`data.on_policy.fraction=F` (rows named `loss+op`), so the divergence and the data are
separate levers. Prints per run, as mean ± std over seeds: held-out α at the recipe's eval
temperature and at T=0, predicted τ(γ) (`tau_pred`, round-aware, docs/theory.md §1) and
*measured* τ(γ) from real speculative decoding at the end of training
(`eval.speculative`, on `--spec-prompts` held-out prompts), and the ratio of τ against
off-policy fkl when fkl is among the losses. `--results` writes that table into its section of
benchmarks/RESULTS.md (benchmarks/results.py).
"""

import argparse
import json
import statistics
from pathlib import Path

from accelerate.state import AcceleratorState, GradientState

from benchmarks import results as results_md
from specdistill.train.config import load_recipe
from specdistill.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]


def run(recipe_path: str, loss: str, seed: int, out: Path, overrides: list[str]) -> dict:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    recipe = load_recipe(
        recipe_path,
        [
            f"loss.name={loss}",
            "train.save_every=0",
            "eval.every=0",  # an override may ask for periodic evaluation (α against steps)
            *overrides,
            f"train.seed={seed}",
            f"train.output_dir={out}",
            "train.resume='no'",
            "train.overwrite=true",
        ],
    )
    return Trainer.from_recipe(recipe).run()


def stored_result(folder: Path) -> dict:
    """A finished run's eval.json, read back as `run` returns it (integer γ keys)."""
    path = folder / "eval.json"
    if not path.is_file():
        raise SystemExit(f"{path}: no finished run there (--report-only trains nothing)")
    result = json.loads(path.read_text())
    for key in ("tau_pred", "tau_pred_iid", "tau_pred_before"):
        if key in result:
            result[key] = {int(g): v for g, v in result[key].items()}
    return result


def split_losses(text: str) -> list[str]:
    """Split --losses on the commas outside braces (a variant's override may hold a dict)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"{": 1, "[": 1, "}": -1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def parse_variant(text: str) -> tuple[str, str, list[str]]:
    """'fkl' -> ('fkl', 'fkl', []); 'LABEL:k=v;k=v' -> (LABEL, loss.name or LABEL, overrides)."""
    label, _, rest = text.partition(":")
    overrides = [o.strip() for o in rest.split(";") if o.strip()]
    loss = label
    for o in overrides:
        key, _, value = o.partition("=")
        if key.strip() == "loss.name":
            loss = value.strip()
    return label, loss, [o for o in overrides if not o.startswith("loss.name")]


def fmt(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def measured_tau(result: dict, gamma: int) -> float | None:
    spec = result.get("speculative") or {}
    return spec.get(f"spec/tau_{gamma}")


def results_section(
    summary: dict, first: dict, seeds: list[int], gamma: int, report_only: bool = False
) -> results_md.Section:
    """The table `main` prints, as this benchmark's section of RESULTS.md: `summary` maps each
    run's label to its per-seed values and `*_ratio_vs_fkl`, `first` is the first run's result
    (its starting point, steps and eval temperature)."""
    g = gamma
    header = [
        "run",
        f"α T={first['temperature']}",
        "α T=0",
        f"τ_pred({g})",
        f"τ measured({g})",
        "τ_pred ÷ fkl",
        "τ measured ÷ fkl",
    ]
    rows = []
    for label, row in summary.items():
        ratios = [row.get(f"{k}_ratio_vs_fkl") for k in ("tau_pred", "tau_measured")]
        rows.append(
            [label]
            + [fmt(row[k]) for k in ("alpha", "alpha_greedy", "tau_pred", "tau_measured")]
            + ["-" if r is None else f"{r:.3f}" for r in ratios]
        )
    note = " Read back from finished runs: without `--report-only` the command trains them."
    body = (
        f"{len(seeds)} seed(s) ({', '.join(map(str, seeds))}), {first['steps']} steps each, "
        f"mean ± std over seeds; before training: α {first['alpha_before']:.4f}, greedy "
        f"{first['alpha_greedy_before']:.4f}, τ_pred({g}) {first['tau_pred_before'][g]:.3f}."
        f"{note if report_only else ''}\n\n{results_md.markdown_table(header, rows)}\n"
    )
    return results_md.Section(key="loss_compare", title="Losses at equal steps", body=body)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "code.yaml"))
    parser.add_argument(
        "--losses",
        default="fkl,tv,lk_alpha,lk_lambda,tau",
        help="comma-separated loss names, or LABEL:OVERRIDE[;OVERRIDE...] for a variant, e.g. "
        "'tv+fkl:loss.name=mix;loss.params={parts: {tv: 0.9, fkl: 0.1}}'",
    )
    parser.add_argument("--seeds", default="0", help="comma-separated training seeds")
    parser.add_argument("--steps", type=int, default=None, help="train.max_steps")
    parser.add_argument("--target", default=None, help="target.model (local dir or hub id)")
    parser.add_argument("--draft", default=None, help="draft.model (local dir or hub id)")
    parser.add_argument("--data", default=None, help="data.train, comma-separated sources")
    parser.add_argument(
        "--on-policy", type=float, default=0.0, help="also run each loss at this fraction"
    )
    parser.add_argument("--on-policy-source", default="draft", choices=("draft", "target"))
    parser.add_argument(
        "--on-policy-losses", default=None, help="labels of --losses run on-policy (default: all)"
    )
    parser.add_argument("--gamma", type=int, default=5, help="γ of the τ columns")
    parser.add_argument(
        "--spec-prompts", type=int, default=8, help="held-out prompts for measured τ (0: off)"
    )
    parser.add_argument("--out", default="runs/loss_compare")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: summarise the runs already in --out (seeds run by several "
        "invocations, say)",
    )
    results_md.add_argument(parser)
    parser.add_argument("overrides", nargs="*", help="recipe overrides, key.sub=value")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    out = Path(args.out)
    seeds = [int(s) for s in args.seeds.split(",")]
    g = args.gamma
    common = common_overrides(args)
    variants = [parse_variant(text) for text in split_losses(args.losses)]
    if args.on_policy > 0:
        variants += on_policy_variants(args, variants, parser)
    results: dict[str, list[dict]] = {label: [] for label, _, _ in variants}
    for seed in seeds:
        for label, loss, extra in variants:
            folder = out / f"{label}-seed{seed}"
            if args.report_only:
                results[label].append(stored_result(folder))
            else:
                results[label].append(run(args.recipe, loss, seed, folder, common + extra))
    first = results[variants[0][0]][0]
    summary = {}
    for label, _, _ in variants:
        rs = results[label]
        summary[label] = {
            "alpha": [r["alpha"] for r in rs],
            "alpha_greedy": [r["alpha_greedy"] for r in rs],
            "tau_pred": [r["tau_pred"][g] for r in rs],
            "tau_measured": [measured_tau(r, g) for r in rs],
        }
    add_ratios_vs_fkl(summary)
    print_table(summary, first, seeds, g)
    out.mkdir(parents=True, exist_ok=True)
    report = {"seeds": seeds, "gamma": g, "steps": first["steps"], "results": summary}
    (out / "summary.json").write_text(json.dumps(report, indent=1))
    if args.results:
        section = results_section(summary, first, seeds, g, args.report_only)
        print(f"wrote {results_md.write(section, args.results)}")
    return report


def common_overrides(args) -> list[str]:
    """The recipe overrides every run shares: the command line's own, then the flags'."""
    common = list(args.overrides)
    if args.steps is not None:
        common.append(f"train.max_steps={args.steps}")
    if args.target:
        common.append(f"target.model={args.target}")
    if args.draft:
        common.append(f"draft.model={args.draft}")
    if args.data:
        common.append(f"data.train={json.dumps(args.data.split(','))}")
    if args.spec_prompts:
        common += [
            "eval.speculative.every=1000000000",  # only at the end of training
            f"eval.speculative.gammas=[{args.gamma}]",
            f"eval.speculative.prompts={args.spec_prompts}",
        ]
    return common


def on_policy_variants(args, variants: list, parser: argparse.ArgumentParser) -> list:
    """The `--on-policy-losses` variants (all by default) again, on-policy, labelled
    `LABEL+op`; a label not among `variants` is a usage error."""
    on = [
        f"data.on_policy.fraction={args.on_policy}",
        f"data.on_policy.source={args.on_policy_source}",
    ]
    chosen = args.on_policy_losses.split(",") if args.on_policy_losses else None
    labels = [label for label, _, _ in variants]
    unknown = [c for c in chosen or [] if c not in labels]
    if unknown:
        parser.error(f"--on-policy-losses {unknown} are not among --losses {labels}")
    return [
        (f"{label}+op", loss, extra + on)
        for label, loss, extra in list(variants)
        if chosen is None or label in chosen
    ]


def add_ratios_vs_fkl(summary: dict) -> None:
    """Each row's mean τ (predicted, measured) over fkl's, as `KEY_ratio_vs_fkl` (None
    without fkl or values)."""
    base = summary.get("fkl")
    for row in summary.values():
        for key in ("tau_pred", "tau_measured"):
            mine = [v for v in row[key] if v is not None]
            ref = [v for v in (base or {}).get(key, []) if v is not None]
            ratio = statistics.mean(mine) / statistics.mean(ref) if mine and ref else None
            row[f"{key}_ratio_vs_fkl"] = ratio


def print_table(summary: dict, first: dict, seeds: list[int], g: int) -> None:
    """The runs' table on stdout, with the starting point and the best run by τ_pred."""
    print(f"\n{len(seeds)} seed(s), {first['steps']} steps each, γ = {g}")
    print(
        f"before: alpha {first['alpha_before']:.4f}, greedy {first['alpha_greedy_before']:.4f}, "
        f"tau_pred({g}) {first['tau_pred_before'][g]:.3f}"
    )
    columns = (
        f"alpha T={first['temperature']}",
        "alpha T=0",
        f"tau_pred({g})",
        f"tau_meas({g})",
        "tau_pred / fkl",
        "tau_meas / fkl",
    )
    print(f"{'run':<14} " + " ".join(f"{c:>18}" for c in columns))
    for label, row in summary.items():
        ratios = [row[f"{key}_ratio_vs_fkl"] for key in ("tau_pred", "tau_measured")]
        ratios = ["-" if ratio is None else f"{ratio:.3f}" for ratio in ratios]
        cells = [fmt(row[k]) for k in ("alpha", "alpha_greedy", "tau_pred", "tau_measured")]
        print(f"{label:<14} " + " ".join(f"{c:>18}" for c in cells + ratios))
    best = max(summary, key=lambda n: statistics.mean(summary[n]["tau_pred"]))
    print(f"best tau_pred({g}): {best}")


if __name__ == "__main__":
    main()
