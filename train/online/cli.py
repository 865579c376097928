"""`specdistill online [rollback | demo] ...`: routes the verb's subcommands.

specdistill online --recipe R [--follow | --once]   -> train/online/job.py (the job)
specdistill online rollback [VERSION] --drafts ROOT -> train/online/dirs.py
specdistill online demo --out DIR [--minutes M]     -> train/online/demo.py
"""

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        from specdistill.train.online.demo import main as demo_main

        return demo_main(argv[1:])
    from specdistill.train.online.job import main as online_main

    return online_main(argv)


if __name__ == "__main__":
    from specdistill.errors import run_guarded

    sys.exit(run_guarded(main, sys.argv[1:]))
