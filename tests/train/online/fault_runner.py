"""`python -m tests.train.online.fault_runner POINT:N [online args...]`: the online job's command
line (`specdistill.train.online.job.main`) with a fault hook that kills the process
(SIGKILL) the N-th time the job reaches POINT, for the crash tests."""

import os
import signal
import sys


def kill_at(spec: str):
    point, _, n = spec.rpartition(":")
    left = {"n": int(n)}

    def hook(reached: str) -> None:
        if reached == point:
            left["n"] -= 1
            if left["n"] <= 0:
                os.kill(os.getpid(), signal.SIGKILL)

    return hook


if __name__ == "__main__":
    from specdistill.errors import run_guarded
    from specdistill.train.online.job import main

    faults = kill_at(sys.argv[1])
    sys.exit(run_guarded(lambda argv: main(argv, faults=faults), sys.argv[2:]))
