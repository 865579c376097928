"""The online job's cursor over the server's traffic shards: (shard name, byte offset of the
next unread line, lines consumed), with a seal of the consumed part of its shard.

Only complete lines (ending in a newline) are consumed; a final line without its newline is
left for later while its shard is the newest (the server may be writing it), and rejected as
torn once a newer shard exists (the server never appends after a torn line, docs/traffic.md).
Shards are read in name order (their sequence numbers) from the cursor's on, never back; only
regular files inside the traffic directory are read.
"""

import bisect
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from specdistill.formats.traffic_shards import shards

SEAL_BYTES = 4096  # a shard's bytes hashed into the cursor: its first and the last consumed
GONE = "gone"  # Cursor.check of a shard deleted under the cursor: read on after its name


@dataclass
class Cursor:
    shard: str | None = None  # the shard being read (None: before the first)
    offset: int = 0  # bytes of `shard` consumed
    lines: int = 0  # lines consumed in all shards (records, rejects, blank lines)
    # What the consumed part of `shard` was (`seal`): its inode and a hash of its first and
    # last consumed SEAL_BYTES; a shard found otherwise was rewritten or truncated under it.
    inode: int | None = None
    check: str | None = None

    def as_dict(self) -> dict:
        return {
            "shard": self.shard,
            "offset": self.offset,
            "lines": self.lines,
            "inode": self.inode,
            "check": self.check,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Cursor":
        return cls(d["shard"], d["offset"], d["lines"], d.get("inode"), d.get("check"))

    def seal(self, directory) -> None:
        """Record what the consumed part of the current shard is now (a shard deleted under
        the cursor stays marked `GONE`)."""
        if self.check != GONE:
            self.inode, self.check = _shard_check(Path(directory), self.shard, self.offset)


def _shard_check(d: Path, name: str | None, offset: int) -> tuple[int | None, str | None]:
    if name is None:
        return None, None
    try:
        with open(d / name, "rb") as f:
            inode = os.fstat(f.fileno()).st_ino
            if os.fstat(f.fileno()).st_size < offset:
                return inode, "truncated"
            head = f.read(min(offset, SEAL_BYTES))
            f.seek(max(0, offset - SEAL_BYTES))
            tail = f.read(min(offset, SEAL_BYTES))
    except OSError:  # gone, or no longer a file
        return None, None
    return inode, hashlib.sha256(head + b"\0" + tail).hexdigest()[:32]


def usable_shards(d: Path) -> tuple[list[str], list[str]]:
    """(names of DIR's shards that are regular files inside DIR, in order; names of the
    others: a directory, a device, a symlink leading out of DIR or nowhere)."""
    inside = d.resolve()
    good, refused = [], []
    for p in shards(d):
        try:
            real = p.resolve(strict=True)
            ok = real.parent == inside and stat.S_ISREG(real.stat().st_mode)
        except (OSError, RuntimeError):  # gone, a symlink loop
            ok = False
        (good if ok else refused).append(p.name)
    return good, refused


def read_new(directory, cursor: Cursor, max_line_bytes: int):
    """Yield (shard name, offset, raw line bytes | None, reason) for each complete line after
    `cursor`, advancing it as each one is yielded (the caller processes it before the next).
    `raw` is None for an oversized or torn line (reason says which), and for an event, yielded
    before any line: "not_a_shard" (a shard's name on something that is not a regular file
    inside DIR: skipped), "shard_rewritten" (the cursor's shard is no longer what the cursor
    consumed: shorter than the cursor's offset, another file, or other bytes; it is read again
    from its start, the store's prompt deduplication refusing the records already taken) or
    "shard_gone" (deleted: reading goes on with the first shard named after it, never an
    earlier one). Shards are read in name order from the cursor's on."""
    d = Path(directory)
    if not d.is_dir():
        return
    names, refused = usable_shards(d)
    for name in refused:
        yield name, 0, None, "not_a_shard"
    if cursor.shard is not None and cursor.shard not in names:
        if cursor.check != GONE:
            cursor.offset, cursor.inode, cursor.check = 0, None, GONE
            yield cursor.shard, 0, None, "shard_gone"
    elif cursor.check == GONE:  # a new shard of the same name: read from its start
        cursor.offset, cursor.inode, cursor.check = 0, None, None
    elif cursor.shard is not None and cursor.check is not None:
        if _shard_check(d, cursor.shard, cursor.offset) != (cursor.inode, cursor.check):
            cursor.offset = 0
            cursor.inode = cursor.check = None
            yield cursor.shard, 0, None, "shard_rewritten"
    start = bisect.bisect_left(names, cursor.shard) if cursor.shard is not None else 0
    for i in range(start, len(names)):
        name = names[i]
        if name != cursor.shard:
            cursor.shard, cursor.offset = name, 0
            cursor.inode = cursor.check = None
        yield from _read_shard(d / name, cursor, max_line_bytes, newest=i == len(names) - 1)


def _read_shard(path: Path, cursor: Cursor, max_line_bytes: int, *, newest: bool):
    """`read_new`'s lines of one shard, from the cursor's offset."""
    name = path.name
    try:
        f = open(path, "rb")
    except FileNotFoundError:  # deleted since it was listed: the next read reports it
        return
    with f:
        f.seek(cursor.offset)
        while True:
            at = cursor.offset
            raw = f.readline(max_line_bytes + 1)
            if not raw:
                break
            if len(raw) > max_line_bytes or not raw.endswith(b"\n"):
                total, complete = len(raw), raw.endswith(b"\n")
                while not complete:  # find the end of this line
                    chunk = f.readline(1 << 20)
                    if not chunk:
                        break
                    total += len(chunk)
                    complete = chunk.endswith(b"\n")
                if not complete and newest:
                    return  # possibly still being written: wait for its newline
                cursor.offset = at + total
                cursor.lines += 1
                yield name, at, None, ("oversized_line" if complete else "torn_line")
                if not complete:
                    break
                continue
            cursor.offset += len(raw)
            cursor.lines += 1
            yield name, at, raw, None
