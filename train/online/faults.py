"""Crash injection for the online job's crash tests: SPECDISTILL_ONLINE_FAULT=point:n kills
the process (SIGKILL) the n-th time the job reaches `point`; a test may also set
`FAULT.hook`, called with each point's name. Nothing happens when neither is set."""

import os
import signal


class _Faults:
    """Crash injection for the tests: SPECDISTILL_ONLINE_FAULT=point:n kills the process
    (SIGKILL) the n-th time `point` is reached; tests may also replace `hook`."""

    def __init__(self):
        spec = os.environ.get("SPECDISTILL_ONLINE_FAULT", "")
        self.point, _, n = spec.rpartition(":") if spec.count(":") > 1 else spec.partition(":")
        self.left = int(n or 1)
        self.hook = None

    def __call__(self, point: str) -> None:
        if self.hook is not None:
            self.hook(point)
        if self.point and point == self.point:
            self.left -= 1
            if self.left <= 0:
                os.kill(os.getpid(), signal.SIGKILL)


FAULT = _Faults()
