"""Atomic publication of files and directories: the one way the project puts outputs in place.

A reader, or a rerun after a kill or a power cut, finds either the previous version of an
output or the complete new one, never a half-written one. Everything is written beside its
final path first, flushed to disk (each file and each directory holding them), then renamed
into place: a rename within one file system is atomic, and the fsyncs before it make sure
the rename cannot reach the disk before the data it points at.

Leftovers of a kill are named `.tmp-*` (the caller's temporary directory), `.<name>.tmp-*`
(a temporary file of `atomic_write_text`) and `.old-<name>-*` (a replaced directory not yet
removed), all beside the final path, so the next run can recognise and delete them.

Standard library only, so that any part of the project can import it.
"""

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def fsync_path(path: str | os.PathLike) -> None:
    """Flush one file or directory to disk (a directory: its entries, i.e. renames into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """Flush every file and directory under `path`, and `path` itself, bottom-up."""
    for root, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)


def publish_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Rename the complete directory `tmp` to `final` (same file system, e.g. a sibling).

    An existing `final` is replaced only once the new one is complete on disk: it is moved
    aside to `.old-<name>-*`, the new one renamed in, the old one deleted. If the rename
    fails, the old one is put back. A kill between the two renames leaves no `final` but
    the complete old version beside it (callers delete such leftovers on their next run).
    """
    tmp, final = Path(tmp), Path(final)
    fsync_tree(tmp)
    final.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".old-{final.name}-", dir=final.parent))
        os.replace(final, old)  # a directory may be renamed onto an empty one
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """Write `text` to `path` so that `path` holds either its old content or all of `text`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding=encoding) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; outputs are as readable as any file
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_path(path.parent)
