"""The traffic log: one JSON line per completed request, in size-rotated shards.

    DIR/traffic-000001.jsonl, DIR/traffic-000002.jsonl, ...

Each record is written with one `os.write` of the whole line (newline included) on a file
opened for appending, then fsynced, so a crash leaves at most one torn *final* line, never a
torn line in the middle; `read_traffic` skips a final line without its newline. A server
starting on a directory that already has shards opens the next shard number, so it never
appends after a torn line. docs/traffic.md documents the schema (`SCHEMA_VERSION`).
"""

import json
import os
import re
import threading
from pathlib import Path

from specdistill.errors import UserError

SCHEMA_VERSION = 1
SHARD = re.compile(r"^traffic-(\d{6})\.jsonl$")
DEFAULT_SHARD_BYTES = 64 * 1024 * 1024


class TrafficError(UserError):
    """A traffic record that does not follow the schema (file and line named)."""


# field -> accepted types (None allowed where listed); docs/traffic.md
_NUM = (int, float)
SCHEMA: dict[str, tuple] = {
    "schema_version": (int,),
    "id": (str,),
    "time": _NUM,
    "endpoint": (str,),
    "target": (dict,),
    "draft_version": (str, type(None)),
    "sampling": (dict,),
    "prompt": (str, list),
    "prompt_token_ids": (list,),
    "completion_token_ids": (list,),
    "completion_text": (str,),
    "finish_reason": (str,),
    "speculative": (dict,),
    "category": (str, type(None)),
    "top_logprobs": (list, type(None)),
    "latency_s": _NUM,
    "ttft_s": _NUM + (type(None),),
}
# fields a record may lack (a record without them is valid)
OPTIONAL: dict[str, tuple] = {
    "client": (str, type(None)),  # `key-<sha256(key)[:12]>` of the API key used; null: no key
}
SAMPLING_KEYS = ("temperature", "top_p", "max_tokens", "seed", "stop")
SPECULATIVE_KEYS = (
    "mean_acceptance_length",
    "draft_acceptance_rate",
    "acceptance_histogram",
    "num_spec_steps",
    "num_draft_tokens",
    "num_accepted_draft_tokens",
)


def validate(record: dict) -> dict:
    """Raise TrafficError unless `record` follows schema version 1; return it."""
    if not isinstance(record, dict):
        raise TrafficError(f"a record is a JSON object, got {type(record).__name__}")
    if record.get("schema_version") != SCHEMA_VERSION:
        version = record.get("schema_version")
        raise TrafficError(f"schema_version {version!r} is not {SCHEMA_VERSION}")
    for key, types in SCHEMA.items():
        if key not in record:
            raise TrafficError(f"field {key!r} missing")
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, types):
            raise TrafficError(f"field {key!r} has type {type(value).__name__}")
    for key, types in OPTIONAL.items():
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, types):
            raise TrafficError(f"field {key!r} has type {type(value).__name__}")
    for key in ("name", "identity"):
        if not isinstance(record["target"].get(key), str):
            raise TrafficError(f"target.{key} missing or not a string")
    for name, keys in (("sampling", SAMPLING_KEYS), ("speculative", SPECULATIVE_KEYS)):
        missing = [k for k in keys if k not in record[name]]
        if missing:
            raise TrafficError(f"{name} lacks {', '.join(missing)}")
    for key in ("prompt_token_ids", "completion_token_ids"):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in record[key]):
            raise TrafficError(f"{key} must be a list of integers")
    top = record["top_logprobs"]
    if top is not None:
        if len(top) != len(record["completion_token_ids"]):
            raise TrafficError("top_logprobs needs one entry per completion token")
        for entry in top:
            if not all(
                isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int)
                for pair in entry
            ):
                raise TrafficError("top_logprobs entries are lists of [token_id, logprob]")
    return record


class TrafficLog:
    """Appends records to DIR/traffic-NNNNNN.jsonl; a new shard past `max_bytes`. Thread-safe."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int = DEFAULT_SHARD_BYTES):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        existing = [int(m[1]) for p in self.dir.iterdir() if (m := SHARD.match(p.name))]
        self.index = max(existing, default=0)
        self.fd: int | None = None
        self.size = 0
        self.count = 0  # records written by this process
        self._open_next()

    def _open_next(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
        self.index += 1
        path = self.dir / f"traffic-{self.index:06d}.jsonl"
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.size = os.fstat(self.fd).st_size
        _fsync_dir(self.dir)

    @property
    def path(self) -> Path:
        return self.dir / f"traffic-{self.index:06d}.jsonl"

    def append(self, record: dict) -> None:
        """Validate and write one record as one line: one write, flush, fsync."""
        validate(record)
        line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
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


def shards(directory: str | os.PathLike) -> list[Path]:
    """The shard files of DIR in order."""
    d = Path(directory)
    return sorted((p for p in d.iterdir() if SHARD.match(p.name)), key=lambda p: p.name)


def read_traffic(directory: str | os.PathLike) -> list[dict]:
    """Every record of DIR's shards, in order, each validated (TrafficError names the file and
    line of the first bad one). A shard's final line without a newline (a write cut short by a
    crash) is skipped."""
    records = []
    for path in shards(directory):
        data = path.read_bytes()
        lines = data.split(b"\n")
        for number, raw in enumerate(lines[:-1], 1):  # lines[-1]: after the last newline
            if not raw.strip():
                continue
            try:
                records.append(validate(json.loads(raw)))
            except (json.JSONDecodeError, UnicodeDecodeError, TrafficError) as e:
                raise TrafficError(f"{path}:{number}: {e}") from e
    return records
