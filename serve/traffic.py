"""The traffic log's writer: one JSON line per completed request (formats/traffic.py
`TrafficRecord`), appended to size-rotated shards (formats/traffic_shards.py).

Each record is written with one `os.write` of the whole line (newline included) on a file
opened for appending, then fsynced, so a crash leaves at most one torn *final* line, never a
torn line in the middle, which the readers skip. A server starting on a directory that
already has shards opens the next shard number, so it never appends after a torn line.
"""

import os
import threading
from pathlib import Path

from specdistill.formats.traffic import TrafficRecord, parse_record
from specdistill.formats.traffic_shards import shard_index, shard_name

DEFAULT_SHARD_BYTES = 64 * 1024 * 1024


class TrafficLog:
    """Appends records to DIR/traffic-NNNNNN.jsonl; a new shard past `max_bytes`. Thread-safe."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int = DEFAULT_SHARD_BYTES):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        existing = [i for p in self.dir.iterdir() if (i := shard_index(p.name)) is not None]
        self.index = max(existing, default=0)
        self.fd: int | None = None
        self.size = 0
        self.count = 0  # records written by this process
        self._open_next()

    def _open_next(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
        self.index += 1
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.size = os.fstat(self.fd).st_size
        _fsync_dir(self.dir)

    @property
    def path(self) -> Path:
        return self.dir / shard_name(self.index)

    def append(self, record: TrafficRecord | dict) -> None:
        """Validate and write one record as one line: one write, flush, fsync."""
        if not isinstance(record, TrafficRecord):
            record = parse_record(record)
        line = record.line()
        with self.lock:
            if self.size > 0 and self.size + len(line) > self.max_bytes:
                self._open_next()
            written = os.write(self.fd, line)
            if written != len(line):  # a full disk: never leave a line without its end
                os.ftruncate(self.fd, self.size)
                raise OSError(f"{self.path}: short write ({written} of {len(line)} bytes)")
            os.fsync(self.fd)
            self.size += written
            self.count += 1

    def close(self) -> None:
        with self.lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
