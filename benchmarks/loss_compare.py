"""Distil the same draft with each loss at equal steps and compare held-out acceptance.

    python benchmarks/loss_compare.py                       # embedded pair, recipes/code.yaml
    python benchmarks/loss_compare.py --losses fkl,tv --seeds 0,1,2 train.max_steps=300

Each run starts from the same pretrained draft; only the loss (and, across seeds, the
order of training sequences) changes. Prints held-out α at the recipe's eval temperature
and at T=0, and predicted τ(γ=5), as mean ± std over seeds.
"""

import argparse
import json
import statistics
from pathlib import Path

from accelerate.state import AcceleratorState, GradientState

from specdistill.train.config import load_recipe
from specdistill.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]


def run(recipe_path: str, loss: str, seed: int, out: Path, overrides: list[str]) -> dict:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    recipe = load_recipe(
        recipe_path,
        [
            *overrides,
            f"loss.name={loss}",
            f"train.seed={seed}",
            f"train.output_dir={out / f'{loss}-seed{seed}'}",
            "train.save_every=0",
            "eval.every=0",
        ],
    )
    return Trainer.from_recipe(recipe).run()


def fmt(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "code.yaml"))
    parser.add_argument("--losses", default="fkl,tv,lk_alpha,lk_lambda")
    parser.add_argument("--seeds", default="0", help="comma-separated training seeds")
    parser.add_argument("--out", default="runs/loss_compare")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, key.sub=value")
    args = parser.parse_args()
    out = Path(args.out)
    seeds = [int(s) for s in args.seeds.split(",")]
    names = args.losses.split(",")
    results: dict[str, list[dict]] = {name: [] for name in names}
    for seed in seeds:
        for name in names:
            results[name].append(run(args.recipe, name, seed, out, args.overrides))
    first = results[names[0]][0]
    header = (
        f"{'loss':<12} {'alpha T=' + str(first['temperature']):>18} {'alpha T=0':>18} "
        f"{'tau_pred(5)':>18}   (before: alpha {first['alpha_before']:.4f}, "
        f"greedy {first['alpha_greedy_before']:.4f}, tau(5) {first['tau_pred_before'][5]:.3f})"
    )
    print(f"\n{len(seeds)} seed(s), {first['steps']} steps each")
    print(header)
    summary = {}
    for name in names:
        rs = results[name]
        row = {
            "alpha": [r["alpha"] for r in rs],
            "alpha_greedy": [r["alpha_greedy"] for r in rs],
            "tau5": [r["tau_pred"][5] for r in rs],
        }
        summary[name] = row
        cells = [fmt(row[key]) for key in ("alpha", "alpha_greedy", "tau5")]
        print(f"{name:<12} " + " ".join(f"{cell:>18}" for cell in cells))
    best = max(names, key=lambda n: statistics.mean(summary[n]["alpha"]))
    print(f"best held-out alpha at T={first['temperature']}: {best}")
    (out / "summary.json").write_text(json.dumps({"seeds": seeds, "results": summary}, indent=1))


if __name__ == "__main__":
    main()
