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
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
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


def remove_leftovers(folder: str | os.PathLike) -> None:
    """Delete what a kill left of an atomic publish in `folder`: temporary directories and
    files (`.tmp-*`, `.<name>.tmp-*`) and replaced directories not yet deleted (`.old-*`).
    None of them is ever read."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        name = path.name
        if name.startswith((".tmp-", ".old-")) or (name.startswith(".") and ".tmp-" in name):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


class OutputDirError(ValueError):
    """An output directory that a command would overwrite, or that another process holds."""


def claim_output_dir(out: str | os.PathLike, *, overwrite: bool, flag: str = "--overwrite") -> Path:
    """Make `out` ready for a command's outputs, never silently replacing earlier ones.

    A missing or empty directory is created and used; one that holds files is refused with
    a message naming them and `flag`, unless `overwrite` (then its files are left for the
    command to replace one by one, atomically). A path that is a file is refused.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{out} is a file, not a directory")
    if out.is_dir() and not overwrite:
        used = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
        if used:
            shown = ", ".join(used[:5]) + (f" and {len(used) - 5} more" if len(used) > 5 else "")
            raise OutputDirError(
                f"{out} already holds {shown}: choose another directory, or pass {flag} to "
                "replace them"
            )
    out.mkdir(parents=True, exist_ok=True)
    return out


class DirLock:
    """An exclusive lock on a directory, held while one process writes into it.

    `with DirLock(root, "online job"):` takes `root/.lock` with `flock`, so a second process
    asking for it fails at once with a message naming the holder's pid, and a killed holder
    releases it (the kernel drops the lock with the process). The lock file stays behind;
    it holds only the last holder's pid and is never read for anything else.
    """

    def __init__(self, root: str | os.PathLike, what: str = "another process"):
        self.path = Path(root) / ".lock"
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> "DirLock":
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a directory named .lock, a read-only or full disk, ...
            raise OutputDirError(
                f"{self.path}: cannot take the lock ({e.strerror or e}); remove it if it is "
                "not a file, or use a writable directory"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OutputDirError(
                f"{self.path.parent} is in use by {self.what} (pid {holder}); two writers "
                "would race on its files: stop that one first, or use another directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> "DirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def waiting_lock(root: str | os.PathLike, on_wait: Callable[[str], None]) -> Iterator[None]:
    """An exclusive `flock` on `root/.lock`, waited for (unlike `DirLock`): a build that a
    second process also asked for runs once, the second then finds it done. `on_wait` is told
    once when another process holds it. The lock file is never deleted (two processes would
    lock different files); the kernel releases a killed holder's lock."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        handle = open(root / ".lock", "a")
    except OSError as e:  # a file where the folder belongs, .lock a directory, read-only
        raise OutputDirError(
            f"{root / '.lock'}: cannot take the lock ({e.strerror or e}); the cache must be a "
            "writable directory (set SPECDISTILL_CACHE to one)"
        ) from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait(f"waiting for another process to finish (lock {root / '.lock'})")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
