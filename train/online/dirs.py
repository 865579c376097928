"""The online job's two directories: OUT (`online.output_dir`: state/, the logs) and ROOT
(`online.drafts`: the published versions the server follows).

One writer each: a job holds `specdistill.publish.DirLock` on both for its lifetime, and
`online rollback` takes ROOT's, so a second job on the same OUT or ROOT, or a rollback while
a job runs, fails at once naming the holder's pid.

OUT is this job's own or a new one: `claim_out` accepts a missing or empty directory, or one
the online job made for the same ROOT (OUT/.online-job names it; a restart resumes there).
Anything else (another command's outputs, or a job's for another ROOT) is refused naming
its files, unless `online.overwrite` is true: then the job takes it over and replaces its
state and logs.
"""

import json
import shutil
from pathlib import Path

from specdistill.errors import UserFileError
from specdistill.publish import DirLock, OutputDirError, atomic_write_text, claim_output_dir
from specdistill.train.online.args import rollback_parser
from specdistill.train.online.versions import rollback
from specdistill.train.run_plan import STATE_FILE

MARKER = ".online-job"  # OUT/.online-job: {"drafts": ROOT}, written when a job takes OUT
LOGS = ("rejects.jsonl", "decisions.jsonl", "metrics.jsonl")
STATE = "state"  # OUT/state: the job's checkpoint (train/run_dir.py), replaced at each commit
HOLDER = "an online job or rollback"


def lock_dirs(out: Path, root: Path, *, overwrite: bool | None = None) -> list[DirLock]:
    """DirLocks on OUT and ROOT (one when they are the same directory), taken now; with
    `overwrite` not None, OUT is claimed (`claim_out`) between the two, before ROOT (which
    may lie inside OUT) is created. A path that is a file (or lies under one) is refused
    first, naming its recipe key."""
    check_dir_path("online.output_dir", out)
    check_dir_path("online.drafts", root)
    locks = [DirLock(out, HOLDER).acquire()]
    try:
        if overwrite is not None:
            claim_out(out, root, overwrite=overwrite)
        if root.resolve() != out.resolve():
            locks.append(DirLock(root, HOLDER).acquire())
    except BaseException:
        release(locks)
        raise
    return locks


def check_dir_path(key: str, path: Path) -> None:
    """`UserFileError` unless `path` is a directory or can be made one: it, or the nearest
    of its parents that exists, is something other than a directory."""
    for where in (path, *path.parents):
        if where.exists() or where.is_symlink():
            if where.is_dir():
                return
            what = "is" if where == path else f"lies under {where}, which is"
            raise UserFileError(
                f"{key} {path} {what} not a directory (a file, or a broken symlink); "
                "choose a directory"
            )


def release(locks: list[DirLock]) -> None:
    for lock in reversed(locks):
        lock.release()


def claim_out(out: Path, root: Path, *, overwrite: bool) -> bool:
    """Make OUT the job's output directory; True when it holds this job's state to resume
    from (OUT/state), False when the job starts afresh there (any old state and logs gone)."""
    root_id = str(root.resolve())
    marker = out / MARKER
    made_for = None
    if marker.is_file():
        try:
            made_for = json.loads(marker.read_text()).get("drafts")
        except (ValueError, AttributeError):
            made_for = "?"
    own = made_for == root_id or (made_for is None and has_state(out))
    if made_for is not None and made_for != root_id and not overwrite:
        raise OutputDirError(
            f"{out} holds the online job's state for the drafts root {made_for}, not "
            f"{root_id}: choose another online.output_dir, or set online.overwrite=true to "
            "replace its state and logs"
        )
    if not own:
        if not only_root(out, root):
            claim_output_dir(out, overwrite=overwrite, flag="online.overwrite=true")
        forget(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(marker, json.dumps({"drafts": root_id}) + "\n")
    return own and has_state(out)


def has_state(out: Path) -> bool:
    """Whether OUT holds a committed state of the job."""
    return (out / STATE / STATE_FILE).is_file()


def only_root(out: Path, root: Path) -> bool:
    """Whether ROOT lies inside OUT (the default runs/online/drafts in runs/online) and is
    all that OUT holds, dot files aside: a first start with the drafts root made already."""
    try:
        top = root.resolve().relative_to(out.resolve()).parts[:1]
    except ValueError:
        return False
    if not top or not out.is_dir():
        return False
    return {p.name for p in out.iterdir() if not p.name.startswith(".")} <= {top[0]}


def forget(out: Path) -> None:
    """Delete the job's state and logs in OUT (a fresh start)."""
    shutil.rmtree(out / STATE, ignore_errors=True)
    for name in LOGS:
        (out / name).unlink(missing_ok=True)


def rollback_main(argv: list[str]) -> int:
    """`specdistill online rollback [VERSION] --drafts ROOT`."""
    args = rollback_parser().parse_args(argv)
    root = Path(args.drafts)
    if root.exists() and not root.is_dir():
        raise UserFileError(f"--drafts {root} is not a directory (the published root)")
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such drafts root")
    with DirLock(root, HOLDER):
        old, new = rollback(root, args.version)
    print(f"rolled back {args.drafts}: current {old} -> {new}")
    return 0
