"""What a training step costs with the live target against a target cache, in one process.

    python -m benchmarks.step_cost --recipe recipes/smollm2-standalone.yaml \\
        --cache runs/smollm2-cache --steps 8

Builds two trainers from the recipe, one on the live target and one with
`target.cache=--cache` (built first with `specdistill cache --columns draft` for a draft over
a reduced vocabulary, `--columns top-n` otherwise), gives them the same draft weights, and
runs their optimiser steps in turns: live step i, cached step i, live step i + 1, ... so
that a machine that slows down slows both. Step 0 of each is a warm-up and not counted.
Prints each side's median step time and the cached / live ratio. Run it alone on the machine.
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
        live = Trainer.from_recipe(
            load_recipe(args.recipe, [*common, f"train.output_dir={tmp}/live"])
        )
        cached = Trainer.from_recipe(
            load_recipe(
                args.recipe,
                [*common, f"train.output_dir={tmp}/cached", f"target.cache={args.cache}"],
            )
        )
        cached.draft.load_state_dict(live.draft.state_dict())
        times = {"live": [], "cached": []}
        for step in range(args.steps + 1):
            for name, trainer in (("live", live), ("cached", cached)):
                start = time.perf_counter()
                trainer.train_step(step)
                if step:
                    times[name].append(time.perf_counter() - start)
    live_s, cached_s = (statistics.median(times[n]) for n in ("live", "cached"))
    recipe = live.recipe
    print(
        f"{args.recipe}: batch {recipe.train.global_batch_size} × {recipe.data.max_length}, "
        f"{args.threads} thread(s), median of {args.steps} steps each, taking turns"
    )
    print("| target | s / step | ratio |")
    print("|---|---|---|")
    print(f"| live | {live_s:.2f} | 1.00 |")
    print(f"| cache ({args.cache}) | {cached_s:.2f} | {cached_s / live_s:.2f} |")


if __name__ == "__main__":
    main()
