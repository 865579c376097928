"""Train the same draft from the live target and from target caches at equal steps.

    python benchmarks/cache_vs_live.py                          # embedded pair, recipes/code.yaml
    python benchmarks/cache_vs_live.py --top-n 20,64 --train-records 150 train.max_steps=40

One run on the live target, then per N a cache of the training split (`specdistill cache`,
train/cache.py, float16 values) and a run with `target.cache` on it: same recipe, seed and
sequence order. Held-out α is always measured against the live target, so the numbers
compare what each draft reaches, not how each target scores it. Prints, and writes to
OUT/cache_vs_live.json, per run: held-out α (T = eval temperature) and greedy α, training
seconds, and for a cache its build seconds and bytes per token.
"""

import argparse
import json
import time
from pathlib import Path

from accelerate.state import AcceleratorState, GradientState

from specdistill.train.cache import build_cache
from specdistill.train.config import load_recipe
from specdistill.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
HIDDEN_CACHE = 4096 * 2 * (3 + 1)  # Llama-3.1-8B, bf16, 3 aux layers + the last (speculators)


def train(recipe_path: str, out: Path, overrides: list[str]) -> tuple[dict, float]:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    recipe = load_recipe(
        recipe_path,
        [
            *overrides,
            f"train.output_dir={out}",
            "train.overwrite=true",
            "train.resume='no'",
            "train.save_every=0",
            "eval.every=0",
        ],
    )
    start = time.perf_counter()
    result = Trainer.from_recipe(recipe).run()
    return result, time.perf_counter() - start


def subset(out: Path, k: int) -> Path:
    """The first k text records of embedded:code as OUT/train-subset.jsonl."""
    from specdistill.data.sources import read_records

    out.mkdir(parents=True, exist_ok=True)
    path = out / "train-subset.jsonl"
    with open(path, "w") as f:
        for i, record in enumerate(read_records(["embedded:code"])):
            if i == k:
                break
            f.write(json.dumps({"text": record.text}) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "code.yaml"))
    parser.add_argument("--top-n", default="20,64", help="comma-separated cache sizes N")
    parser.add_argument("--out", default="runs/cache_vs_live")
    parser.add_argument(
        "--train-records",
        type=int,
        default=0,
        help="train on the first K records of embedded:code only (0 = the recipe's data): "
        "a cache covers the whole training split, which is 11k sequences for recipes/code.yaml",
    )
    parser.add_argument("overrides", nargs="*", help="recipe overrides, key.sub=value")
    args = parser.parse_args()
    out = Path(args.out)
    if args.train_records:
        args.overrides = [*args.overrides, f"data.train={subset(out, args.train_records)}"]
    rows = []
    result, seconds = train(args.recipe, out / "live", args.overrides)
    rows.append(
        {
            "run": "live",
            "alpha": result["alpha"],
            "alpha_greedy": result["alpha_greedy"],
            "alpha_before": result["alpha_before"],
            "train_s": seconds,
        }
    )
    for n in [int(x) for x in args.top_n.split(",")]:
        cache = out / f"cache-top{n}"
        recipe = load_recipe(args.recipe, [*args.overrides, f"train.output_dir={out / 'unused'}"])
        start = time.perf_counter()
        manifest = build_cache(recipe, cache, top_n=n, splits=("train",), overwrite=True)
        build_s = time.perf_counter() - start
        result, seconds = train(
            args.recipe, out / f"top{n}", [*args.overrides, f"target.cache={cache}"]
        )
        rows.append(
            {
                "run": f"cache top-{n}",
                "alpha": result["alpha"],
                "alpha_greedy": result["alpha_greedy"],
                "alpha_before": result["alpha_before"],
                "train_s": seconds,
                "build_s": build_s,
                "bytes_per_token": manifest["bytes_per_token"],
                "positions": manifest["positions"],
                "total_bytes": manifest["total_bytes"],
            }
        )
    steps = result["steps"]
    print(
        f"\n{steps} steps; held-out α against the live target (hidden-state cache of "
        f"Llama-3.1-8B for scale: {HIDDEN_CACHE} bytes/token)"
    )
    print(f"{'run':<14} {'alpha':>7} {'greedy':>7} {'train s':>8} {'bytes/token':>12}")
    for row in rows:
        size = f"{row['bytes_per_token']:.1f}" if "bytes_per_token" in row else "-"
        print(
            f"{row['run']:<14} {row['alpha']:7.4f} {row['alpha_greedy']:7.4f} "
            f"{row['train_s']:8.1f} {size:>12}"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "cache_vs_live.json").write_text(json.dumps({"steps": steps, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
