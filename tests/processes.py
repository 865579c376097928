"""Helpers for tests that start processes: a free port, and a run bounded in time that turns a
hang into a failure showing where every process was.

Multi-process runs (accelerate launch, torchrun) each get their own rendezvous port from
`free_port`: accelerate's default 29500 may be in use by another run on the same machine.
"""

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, grandchildren, ...), read from /proc. torchrun
    starts its workers in sessions of their own, so a process group does not reach them."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])  # the name may hold spaces and ")"
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run_bounded(cmd: list[str], *, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run `cmd` to completion, its output captured. Past `timeout` seconds the test fails: every
    process of the run is sent SIGABRT, which makes Python print each one's stack
    (PYTHONFAULTHANDLER), and the failure shows the tail of the output with those stacks,
    instead of a bare timeout that says nothing of where the run stood."""
    proc = subprocess.Popen(
        cmd,
        env={**env, "PYTHONFAULTHANDLER": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        below = descendants(proc.pid)
        _signal(below, signal.SIGABRT)  # the workers first: their stacks are the story
        time.sleep(2)
        _signal([proc.pid, *below], signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            _signal([proc.pid, *descendants(proc.pid)], signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(
            f"{' '.join(cmd[:6])} ... did not finish in {timeout:g} s; each process's stack "
            f"follows.\n--- stdout (tail)\n{out[-3000:]}\n--- stderr (tail)\n{err[-12000:]}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def why_failed(proc: subprocess.CompletedProcess, limit: int = 6000) -> str:
    """What a failed multi-process run printed that says why: each "Fatal Python error" with its
    thread stacks (PYTHONFAULTHANDLER; the list of extension modules that follows is dropped), the
    Python tracebacks, and then the tails of stdout and stderr."""
    stories, keep = [], False
    for line in proc.stderr.splitlines():
        if line.startswith(("Fatal Python error", "Traceback", "terminate called")):
            keep = True
        elif line.startswith("Extension modules:"):
            keep = False
        if keep:
            stories.append(line)
    return (
        f"exit {proc.returncode}\n--- crashes and tracebacks\n"
        + "\n".join(stories)[:limit]
        + f"\n--- stdout (tail)\n{proc.stdout[-1500:]}\n--- stderr (tail)\n{proc.stderr[-1500:]}"
    )
