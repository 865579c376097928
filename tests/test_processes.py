import os
import sys

import pytest

from tests.processes import descendants, run_bounded

# a parent that starts a child in a session of its own (as torchrun does), then both sleep
HANG = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import time\\ndef child_waits():\\n"
    "    time.sleep(60)\\nchild_waits()'], start_new_session=True)\n"
    "def parent_waits():\n    time.sleep(60)\nparent_waits()\n"
)


def test_a_hang_fails_with_the_stack_of_every_process_and_leaves_none_behind():
    before = set(descendants(os.getpid()))
    with pytest.raises(pytest.fail.Exception) as failure:
        run_bounded([sys.executable, "-c", HANG], env=dict(os.environ), timeout=3)
    message = str(failure.value)
    assert "did not finish in 3 s" in message
    assert "parent_waits" in message and "child_waits" in message
    assert set(descendants(os.getpid())) <= before


def test_a_run_that_finishes_returns_its_output():
    proc = run_bounded([sys.executable, "-c", "print('done')"], env=dict(os.environ), timeout=60)
    assert proc.returncode == 0 and proc.stdout == "done\n"
