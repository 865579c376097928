"""`specdistill online [rollback] ...`: routes the verb's subcommands.

specdistill online --recipe R [--follow | --once]   -> train/online/job.py (the job)
specdistill online rollback [VERSION] --drafts ROOT -> train/online/dirs.py

(`specdistill online demo` runs a server beside the job, a layer above this one:
specdistill/online_demo/, dispatched by specdistill/cli.py.)

Each command's arguments are parsed first with its parser (train/online/args.py), which
imports nothing heavy: --help and a bad argument answer before the job loads torch.
"""

import argparse
import sys

from specdistill.errors import run_guarded
from specdistill.train.online.args import job_parser, rollback_parser
from specdistill.verb_parser import quiet_third_party

SUBVERBS = {"rollback": rollback_parser}


def build_parser() -> argparse.ArgumentParser:
    """The job's parser (`specdistill online`); `SUBVERBS` builds the subcommands'."""
    return job_parser()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "rollback":
        rollback_parser().parse_args(argv[1:])
    else:
        job_parser().parse_args(argv)
    quiet_third_party()
    # lazy: the job loads torch, transformers and accelerate (seconds); --help and a bad
    # argument answer before that
    from specdistill.train.online.job import main as online_main

    return online_main(argv)


if __name__ == "__main__":
    sys.exit(run_guarded(main, sys.argv[1:]))
