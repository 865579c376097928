"""Distil a draft model to a frozen target with an acceptance-optimising loss.

    specdistill distill --recipe recipes/code.yaml                 # one process
    specdistill distill --recipe recipes/code.yaml train.max_steps=50 loss.name=tv

Several processes run the same module under a launcher (the script path, train/distill.py):

    accelerate launch --multi_gpu --num_processes 2 train/distill.py --recipe recipes/code.yaml
                                         # 2 processes; on a machine without GPUs: gloo
    accelerate launch --config_file recipes/accelerate/fsdp.yaml train/distill.py \\
        --recipe recipes/code.yaml           # FSDP2; recipes/accelerate/: DDP, DeepSpeed too

Overrides are `key.sub=value` (values parsed as YAML). Outputs in `train.output_dir`:
recipe.yaml, metrics.jsonl, eval.json, checkpoints/, final/ (the trained draft), best/ (the
draft of the highest held-out α).
A non-empty output_dir is refused unless the run continues it (train.resume=auto, as the
shipped recipes set, or a checkpoint path) or replaces it (train.overwrite=true); a rerun of
a finished run with train.resume=auto prints its result and exits (docs/reliability.md).
An anticipated error (a bad recipe, missing data or model) prints one line and exits 2;
`--debug` or SPECDISTILL_DEBUG=1 shows the traceback instead.
"""

import argparse
import logging
import os
import sys

from specdistill.errors import debugging, one_line, run_guarded
from specdistill.train.config import RecipeError, load_recipe
from specdistill.verb_parser import quiet_third_party, verb_parser


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


def build_parser() -> argparse.ArgumentParser:
    parser = verb_parser("distill", __doc__)
    parser.add_argument(
        "--recipe", help="YAML recipe (e.g. recipes/code.yaml); defaults if omitted"
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of an error (also SPECDISTILL_DEBUG=1)",
    )
    parser.add_argument(
        "overrides", nargs="*", help="key.sub=value overrides (docs/recipe-keys.md)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_third_party()
    if args.debug:
        os.environ["SPECDISTILL_DEBUG"] = "1"
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:
        if debugging():
            raise
        print(f"recipe error: {one_line(e)}", file=sys.stderr)
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

    # lazy: the trainer loads torch, transformers and accelerate (seconds); --help and a bad
    # recipe answer before that
    from specdistill.train.trainer import Trainer

    Trainer.from_recipe(recipe).run()
    return 0


def leave(code: int) -> None:
    """End this process with `code`. One of several processes (torchrun's WORLD_SIZE > 1)
    ends without finalizing the interpreter: gloo's worker threads outlive
    `destroy_process_group` (the device mesh still holds the group), and one that is still
    freeing its last collective's tensors needs the GIL; taking it while the interpreter
    finalizes aborts the process ("terminate called without an active exception", from
    `ProcessGroupGloo::runLoop` freeing an all-gather's work, about 1 run in 15 of
    tests/train/test_sharded.py on a busy machine). Everything the run writes is closed by
    then; the standard streams and logging are flushed first."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(code)

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(run_guarded(main, sys.argv[1:]))
