"""What regenerating the training answers with the target buys (issue 16, item 2): held-out α
after distilling on target-regenerated responses versus on the original data, equal steps,
for a standalone draft and an EAGLE-3 head.

    python -m benchmarks.regen_vs_original        # embedded pair: ~15 min of CPU (2 cores)
    python -m benchmarks.regen_vs_original --steps 100 --records 624 --out runs/regen_vs_original

1. The first `--records` records of the recipe's training data (embedded:code, whole stdlib
   modules) are the original data; `specdistill regenerate` (train/regenerate.py) answers
   their prompts (each record's first `--prompt-tokens` tokens) with the target at
   `--temperature`, `--max-new-tokens` each: the regenerated data.
2. The held-out evaluation text is target-generated too: the same regeneration on the prompts
   of embedded:code-heldout (modules never trained on). Every run evaluates on it (data.eval),
   so the α compared is α on text the target writes, as at serving.
3. A standalone draft (recipes/code-4layer.yaml: the pretrained embedded draft, loss tv) and an
   EAGLE-3 head (recipes/code-eagle3.yaml: a fresh head, loss lk_lambda) are each distilled
   for `--steps` steps of the recipe's batch (16 sequences of 256 tokens) on (a) the
   original and (b) the regenerated data: same recipe, seed, steps and evaluation.
4. Held-out α at T=1 (the recipes' eval.temperature) and at T=0 (greedy agreement) are read
   from each run's eval.json (the trainer's own evaluation against the live target), before
   and after training.

Writes OUT/regen_vs_original.json and prints a table. Regeneration resumes (a rerun reuses
OUT/regen-*); trained runs whose eval.json has `--steps` steps are reused unless --retrain.
"""

import argparse
import json
import time
from pathlib import Path

from accelerate.state import AcceleratorState, GradientState

from specdistill.train.config import load_recipe
from specdistill.train.regenerate import Sampling, regenerate
from specdistill.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"standalone": "code-4layer.yaml", "eagle3": "code-eagle3.yaml"}  # one target
HELDOUT = "embedded:code-heldout"


def original_subset(out: Path, source: str, k: int) -> Path:
    """The first k text records of `source` as OUT/original-train.jsonl."""
    from specdistill.data.sources import read_records

    out.mkdir(parents=True, exist_ok=True)
    path = out / "original-train.jsonl"
    with open(path, "w") as f:
        for i, record in enumerate(read_records([source])):
            if i == k:
                break
            f.write(json.dumps({"text": record.text}) + "\n")
    return path


def regenerated(out: Path, source: str, sampling: Sampling, args) -> tuple[str, dict, float]:
    """(the glob of OUT's regenerated records, the manifest, seconds) for `source`'s prompts."""
    recipe = load_recipe(REPO / "recipes" / "code-4layer.yaml", [f"data.train={source}"])
    start = time.perf_counter()
    manifest = regenerate(
        recipe,
        out,
        sampling=sampling,
        batch_size=args.gen_batch,
        text_prompt_tokens=args.prompt_tokens,
        print=lambda *a: print(*a, flush=True),
    )
    if not manifest["complete"]:
        raise SystemExit(f"regeneration into {out} did not complete (see {out}/failures.jsonl)")
    return str(out / "regen-*.jsonl"), manifest, time.perf_counter() - start


def train(kind: str, data: str, train_glob: str, eval_glob: str, args) -> tuple[dict, float]:
    run_dir = Path(args.out) / f"{kind}-{data}"
    report = run_dir / "eval.json"
    if report.is_file() and not args.retrain:
        result = json.loads(report.read_text())
        if result["steps"] == args.steps:
            return result, float("nan")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    recipe = load_recipe(
        REPO / "recipes" / RECIPES[kind],
        [
            f"data.train={train_glob}",
            f"data.eval={eval_glob}",
            f"train.max_steps={args.steps}",
            f"train.output_dir={run_dir}",
            "train.overwrite=true",
            "train.resume='no'",
            "train.save_every=0",
            "eval.every=0",
            "eval.tau_prompts=0",  # α is the measurement here; no τ replay texts
            *args.overrides,
        ],
    )
    start = time.perf_counter()
    result = Trainer.from_recipe(recipe).run()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=25, help="optimiser steps per run (25)")
    parser.add_argument(
        "--records", type=int, default=256, help="training records (prompts) used (256)"
    )
    parser.add_argument("--out", default="runs/regen_vs_original")
    parser.add_argument("--kinds", default="standalone,eagle3")
    parser.add_argument("--temperature", type=float, default=1.0, help="regeneration T (1.0)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="answer length (128)")
    parser.add_argument(
        "--prompt-tokens", type=int, default=32, help="tokens of each record kept as prompt (32)"
    )
    parser.add_argument("--gen-batch", type=int, default=128, help="prompts decoded together")
    parser.add_argument("--retrain", action="store_true", help="retrain runs already in OUT")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every run")
    args = parser.parse_args()
    out = Path(args.out)
    sampling = Sampling(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=0)
    original = original_subset(out, "embedded:code", args.records)
    regen_glob, regen_manifest, regen_s = regenerated(
        out / "regen-train", str(original), sampling, args
    )
    eval_glob, eval_manifest, eval_s = regenerated(out / "regen-heldout", HELDOUT, sampling, args)
    data = {"original": str(original), "regenerated": regen_glob}
    rows = []
    for kind in args.kinds.split(","):
        for name, train_glob in data.items():
            result, seconds = train(kind, name, train_glob, eval_glob, args)
            rows.append(
                {
                    "draft": kind,
                    "data": name,
                    "alpha_T1": result["alpha"],
                    "alpha_T0": result["alpha_greedy"],
                    "alpha_T1_before": result["alpha_before"],
                    "alpha_T0_before": result["alpha_greedy_before"],
                    "alpha_depth_T1": result.get("alpha_depth"),
                    "tau_pred_5": result["tau_pred"].get("5", result["tau_pred"].get(5)),
                    "eval_positions": result["n_positions"],
                    "train_s": seconds,
                }
            )
    summary = {
        "steps": args.steps,
        "records": args.records,
        "sampling": vars(sampling),
        "prompt_tokens": args.prompt_tokens,
        "regenerate_s": {"train": regen_s, "heldout": eval_s},
        "prompts": {"train": regen_manifest["prompts"], "heldout": eval_manifest["prompts"]},
        "runs": rows,
    }
    (out / "regen_vs_original.json").write_text(json.dumps(summary, indent=1))
    print(
        f"\n{args.steps} steps; held-out α on target-generated text (T={args.temperature:g}, "
        f"{eval_manifest['prompts']} held-out prompts)"
    )
    print(f"{'draft':<11} {'data':<12} {'α T=1':>14} {'α T=0':>14} {'train s':>8}")
    for r in rows:
        print(
            f"{r['draft']:<11} {r['data']:<12} "
            f"{r['alpha_T1_before']:.4f}→{r['alpha_T1']:.4f} "
            f"{r['alpha_T0_before']:.4f}→{r['alpha_T0']:.4f} {r['train_s']:8.1f}"
        )


if __name__ == "__main__":
    main()
