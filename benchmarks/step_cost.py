"""What a training step costs with the live target against a target cache, in one process.

    python -m benchmarks.step_cost --recipe recipes/smollm2-standalone.yaml \\
        --cache runs/smollm2-cache --steps 8

Builds three trainers from the recipe with the same draft weights: on the live target with
the acceptance head computing its labels again over the vocabulary (how a step ran before
it took them from the loss's α), on the live target as shipped, and with
`target.cache=--cache` (built by `specdistill prepare` when the recipe sets target.cache, or
by `specdistill cache --columns draft` for a draft over a reduced vocabulary, `--columns
top-n` otherwise). It runs their optimiser steps in turns (step i of each, then step i + 1),
so that a machine that slows down slows all three. Step 0 of each is a warm-up and not
counted. Prints each side's median step time and its ratio to the first. Run it alone.
"""

import argparse
import statistics
import tempfile
import time

import torch

from specdistill.train.config import load_recipe
from specdistill.train.trainer import Trainer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/smollm2-standalone.yaml")
    parser.add_argument("--cache", required=True, help="a cache built for this recipe")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per side")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="key.sub=value recipe overrides")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        common = [*args.overrides, "eval.every=0", "train.save_every=0", "train.resume=no"]
        sides = {}
        for name, extra in (
            ("live, head labels computed again", ["target.cache=null"]),
            ("live", ["target.cache=null"]),
            (f"cache ({args.cache})", [f"target.cache={args.cache}"]),
        ):
            out = f"train.output_dir={tmp}/{len(sides)}"
            sides[name] = Trainer.from_recipe(load_recipe(args.recipe, [*common, out, *extra]))
        first, *others = sides.values()
        for trainer in others:
            trainer.draft.load_state_dict(first.draft.state_dict())
        if first.core.head_training is not None:  # the labels as the head computed them before
            first.core.head_training.labels_from = lambda *a: False
        times = {name: [] for name in sides}
        for step in range(args.steps + 1):
            for name, trainer in sides.items():
                start = time.perf_counter()
                trainer.train_step(step)
                if step:
                    times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    recipe, base = first.recipe, next(iter(medians.values()))
    print(
        f"{args.recipe}: batch {recipe.train.global_batch_size} × {recipe.data.max_length}, "
        f"{args.threads} thread(s), median of {args.steps} steps each, taking turns"
    )
    print("| target | s / step | ratio |")
    print("|---|---|---|")
    for name, seconds in medians.items():
        print(f"| {name} | {seconds:.2f} | {seconds / base:.2f} |")


if __name__ == "__main__":
    main()
