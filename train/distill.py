"""Distil a draft model to a frozen target with an acceptance-optimising loss.

    accelerate launch train/distill.py --recipe recipes/code.yaml
    accelerate launch --multi_gpu --num_processes 2 train/distill.py --recipe recipes/code.yaml \
        train.max_steps=50 loss.name=tv      # 2 processes; on a machine without GPUs: gloo
    python train/distill.py --recipe recipes/code.yaml train.resume=auto   # single process

Overrides are `key.sub=value` (values parsed as YAML). Outputs in `train.output_dir`:
recipe.yaml, metrics.jsonl, eval.json, checkpoints/, final/ (the trained draft).
"""

import argparse
import os
import sys

from specdistill.train.config import RecipeError, load_recipe


def single_process_despite_request() -> bool:
    """`accelerate launch --cpu --num_processes N` starts ONE process (accelerate's simple
    launcher; it only sets MASTER_ADDR). Training would silently run unsharded."""
    env = os.environ
    return (
        env.get("ACCELERATE_USE_CPU", "").lower() == "true"
        and "MASTER_ADDR" in env
        and not any(
            k in env for k in ("WORLD_SIZE", "LOCAL_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--recipe", help="YAML recipe (e.g. recipes/code.yaml); defaults if omitted"
    )
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = parser.parse_args(argv)
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:
        print(f"recipe error: {e}", file=sys.stderr)
        return 2

    if single_process_despite_request():
        print(
            "error: `accelerate launch --cpu --num_processes N` runs a single process. For N CPU "
            "processes (DDP over gloo) use `accelerate launch --multi_gpu --num_processes N "
            "train/distill.py ...` (works without GPUs) or `torchrun --nproc_per_node N "
            "train/distill.py ...`; for one process drop --num_processes.",
            file=sys.stderr,
        )
        return 2

    from specdistill.train.trainer import Trainer  # heavy imports after the recipe is known to be valid

    Trainer(recipe).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
