"""`specdistill regenerate`'s output directory: its shards of records, the failures file, and
which prompts it already answers (train/regenerate.py writes through these).

    OUT/manifest.json             MANIFEST
    OUT/regen-000001.jsonl, ...   one record per line (SHARD), written by ShardWriter
    OUT/failures.jsonl            FAILURES: one line per prompt still unanswered
"""

import json
import os
import re
from pathlib import Path

SHARD = re.compile(r"^regen-(\d{6})\.jsonl$")
MANIFEST = "manifest.json"
FAILURES = "failures.jsonl"


def answered(out: Path) -> set[str]:
    """Prompt hashes already written in OUT's shards (a torn final line skipped)."""
    done = set()
    for path in sorted(p for p in out.iterdir() if SHARD.match(p.name)):
        lines = path.read_bytes().split(b"\n")
        for raw in lines[:-1]:  # lines[-1]: after the last newline (empty, or torn)
            if raw.strip():
                try:
                    done.add(json.loads(raw)["prompt_hash"])
                except (ValueError, KeyError):
                    continue
    return done


class ShardWriter:
    """Appends whole lines to OUT/regen-NNNNNN.jsonl: one write and an fsync per record, a
    new shard each run and past `max_records`."""

    def __init__(self, out: Path, max_records: int):
        self.out, self.max_records = out, max_records
        existing = [int(m[1]) for p in out.iterdir() if (m := SHARD.match(p.name))]
        self.index = max(existing, default=0)
        for index in existing:  # a kill mid-write: cut the torn final line off
            path = out / f"regen-{index:06d}.jsonl"
            data = path.read_bytes()
            if data and not data.endswith(b"\n"):
                os.truncate(path, data.rfind(b"\n") + 1)
        self.fd = None
        self.count = 0

    def append(self, record: dict) -> None:
        if self.fd is None or self.count >= self.max_records:
            self._next()
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        if os.write(self.fd, line) != len(line):
            raise OSError(f"short write to {self.out}")
        os.fsync(self.fd)
        self.count += 1

    def _next(self) -> None:
        self.close()
        self.index += 1
        path = self.out / f"regen-{self.index:06d}.jsonl"
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.count = 0

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read_failures(path: Path) -> dict[str, dict]:
    """prompt hash -> its latest failure (a file of earlier runs may repeat a hash)."""
    failed: dict[str, dict] = {}
    if path.is_file():
        for raw in path.read_bytes().split(b"\n"):
            try:
                failure = json.loads(raw)
                failed[failure["prompt_hash"]] = failure
            except (ValueError, KeyError, TypeError):
                continue
    return failed


def write_failures(path: Path, failed: dict[str, dict]) -> None:
    from specdistill.publish import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(f) + "\n" for f in failed.values()))
