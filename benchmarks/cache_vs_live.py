"""Train the same draft from the live target and from target caches at equal steps.

    python benchmarks/cache_vs_live.py        # the 4-layer pair, recipes/code-4layer.yaml
    python benchmarks/cache_vs_live.py --top-n 20,64 --train-records 150 train.max_steps=40

One run on the live target, then per N a cache of the training split (`specdistill cache`,
train/target_cache.py, float16 values) and a run with `target.cache` on it: same recipe, seed and
sequence order. Held-out α is always measured against the live target, so the numbers
compare what each draft reaches, not how each target scores it. Prints, and writes to
OUT/cache_vs_live.json, per run: held-out α (T = eval temperature) and greedy α, training
seconds, and for a cache its build seconds, bytes per token and the top-N mass it keeps
(mean and median of 1 − rest); then, for each trained draft, its held-out α split into the
part on the target's top N and the part on the other tokens (`decompose`; `--decompose-only`
redoes just this for the runs already in OUT). The cached runs train on the top N plus a
rest bin holding the dropped mass (docs/theory.md §3).
"""

import argparse
import json
import time
from pathlib import Path

import torch
from accelerate.state import AcceleratorState, GradientState

from specdistill.train.config import load_recipe
from specdistill.train.target_cache_build import build_cache
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


def kept_mass(cache: Path) -> tuple[float, float]:
    """(mean, median) over the cached positions of the top-N mass, 1 − rest."""
    from safetensors.torch import load_file

    rest = torch.cat(
        [load_file(path)["rest"].float() for path in sorted(cache.glob("*.safetensors"))]
    )
    kept = 1 - rest
    return float(kept.mean()), float(kept.median())


@torch.no_grad()
def decompose(recipe_path: str, out: Path, overrides: list[str], runs: list[str], top_ns) -> dict:
    """Where each trained draft's held-out α (T=1) comes from, on the runs' own held-out
    sequences: per N, α on the target's top N (Σ_{top N} min(p, q)), α on the other tokens,
    the mass both put there (p: the rest, q: the draft's), and the coarsened α a rest-bin
    loss sees (Σ_{top N} min(p, q) + min(rest_p, rest_q)). Keyed by run, then N."""
    from specdistill.drafts.align import shifted_logits, target_mask
    from specdistill.drafts.loader import load_draft

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    recipe = load_recipe(recipe_path, [*overrides, f"train.output_dir={out / 'unused'}"])
    trainer = Trainer.from_recipe(recipe)
    vocab = trainer.vocab_size
    drafts = {"before": trainer.draft, **{r: load_draft(str(out / r / "final")) for r in runs}}
    sums: dict = {}
    for batch in trainer.eval_batches():
        mask = target_mask(batch)
        p = shifted_logits(trainer.target, batch, vocab).float().softmax(-1)[mask]
        for name, draft in drafts.items():
            q = shifted_logits(draft.eval(), batch, vocab).float().softmax(-1)[mask]
            overlap = torch.minimum(p, q)
            for n in top_ns:
                index = p.topk(n, dim=-1).indices
                top = overlap.gather(-1, index).sum(-1)
                rest_p = 1 - p.gather(-1, index).sum(-1)
                rest_q = 1 - q.gather(-1, index).sum(-1)
                row = sums.setdefault(name, {}).setdefault(n, torch.zeros(6, dtype=torch.float64))
                row += torch.stack(
                    [
                        overlap.sum(-1).sum(),
                        top.sum(),
                        (overlap.sum(-1) - top).sum(),
                        rest_p.sum(),
                        rest_q.sum(),
                        (top + torch.minimum(rest_p, rest_q)).sum(),
                    ]
                ).double()
            sums[name]["positions"] = sums[name].get("positions", 0) + int(mask.sum())
    keys = ("alpha", "alpha_top_n", "alpha_tail", "rest_p", "rest_q", "alpha_coarse")
    return {
        name: {
            str(n): dict(zip(keys, (row / by_n["positions"]).tolist(), strict=True))
            for n, row in by_n.items()
            if n != "positions"
        }
        for name, by_n in sums.items()
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "code-4layer.yaml"))
    parser.add_argument("--top-n", default="20,64", help="comma-separated cache sizes N")
    parser.add_argument("--out", default="runs/cache_vs_live")
    parser.add_argument(
        "--train-records",
        type=int,
        default=0,
        help="train on the first K records of embedded:code only (0 = the recipe's data): "
        "a cache covers the whole training split, 11k sequences for recipes/code-4layer.yaml",
    )
    parser.add_argument(
        "--decompose-only",
        action="store_true",
        help="only add the α decomposition of the runs already in OUT to its JSON",
    )
    parser.add_argument("overrides", nargs="*", help="recipe overrides, key.sub=value")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    out = Path(args.out)
    if args.train_records:
        args.overrides = [*args.overrides, f"data.train={subset(out, args.train_records)}"]
    top_ns = [int(x) for x in args.top_n.split(",")]
    if args.decompose_only:
        report = json.loads((out / "cache_vs_live.json").read_text())
        runs = ["live", *(f"top{n}" for n in top_ns)]
        report["decomposition"] = decompose(args.recipe, out, args.overrides, runs, top_ns)
        (out / "cache_vs_live.json").write_text(json.dumps(report, indent=1))
        print_decomposition(report["decomposition"])
        return
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
    for n in top_ns:
        result, row = cached_run(args.recipe, out, args.overrides, n)
        rows.append(row)
    steps = result["steps"]
    print_runs(steps, rows)
    runs = ["live", *(f"top{n}" for n in top_ns)]
    decomposition = decompose(args.recipe, out, args.overrides, runs, top_ns)
    print_decomposition(decomposition)
    report = {"steps": steps, "runs": rows, "decomposition": decomposition}
    (out / "cache_vs_live.json").write_text(json.dumps(report, indent=1))


def cached_run(recipe_path: str, out: Path, overrides: list[str], n: int) -> tuple[dict, dict]:
    """Build the top-`n` cache of the training split in OUT/cache-topN and train on it in
    OUT/topN: (the trainer's result, the run's row)."""
    cache = out / f"cache-top{n}"
    recipe = load_recipe(recipe_path, [*overrides, f"train.output_dir={out / 'unused'}"])
    start = time.perf_counter()
    manifest = build_cache(recipe, cache, top_n=n, splits=("train",), overwrite=True)
    build_s = time.perf_counter() - start
    result, seconds = train(recipe_path, out / f"top{n}", [*overrides, f"target.cache={cache}"])
    row = {
        "run": f"cache top-{n}",
        "alpha": result["alpha"],
        "alpha_greedy": result["alpha_greedy"],
        "alpha_before": result["alpha_before"],
        "train_s": seconds,
        "build_s": build_s,
        "bytes_per_token": manifest["bytes_per_token"],
        "kept_mass_mean_median": kept_mass(cache),
        "positions": manifest["positions"],
        "total_bytes": manifest["total_bytes"],
    }
    return result, row


def print_runs(steps: int, rows: list[dict]) -> None:
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


def print_decomposition(decomposition: dict) -> None:
    print("\nheld-out α (T=1) split at the target's top N (p: target, q: draft)")
    print(
        f"{'draft':<8} {'N':>4} {'alpha':>7} {'top N':>7} {'tail':>7} {'p tail':>7} "
        f"{'q tail':>7} {'coarse':>7}"
    )
    for name, by_n in decomposition.items():
        for n, d in by_n.items():
            print(
                f"{name:<8} {n:>4} {d['alpha']:7.4f} {d['alpha_top_n']:7.4f} "
                f"{d['alpha_tail']:7.4f} {d['rest_p']:7.4f} {d['rest_q']:7.4f} "
                f"{d['alpha_coarse']:7.4f}"
            )


if __name__ == "__main__":
    main()
