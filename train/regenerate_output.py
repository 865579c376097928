"""`specdistill regenerate`'s output directory: its shards of records, the failures file, and
which prompts it already answers (train/regenerate.py writes through these).

    OUT/manifest.json             MANIFEST
    OUT/regen-000001.jsonl, ...   one record per line (SHARD), written by ShardWriter
    OUT/failures.jsonl            FAILURES: one line per prompt still unanswered

A shard line that is no record of ours, a failures line that is no failure of ours, or a
manifest that is not the object a run writes, is a `DamagedOutputError` naming it: a rerun
never answers beside files it cannot trust.
"""

import contextlib
import errno
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from specdistill.errors import UserError
from specdistill.publish import atomic_write_text

SHARD = re.compile(r"^regen-(\d{6})\.jsonl$")
MANIFEST = "manifest.json"
FAILURES = "failures.jsonl"


class DamagedOutputError(UserError):
    """An output directory whose files this command did not write as they are."""


def answered(out: Path) -> set[str]:
    """Prompt hashes already written in OUT's shards (a torn final line skipped);
    DamagedOutputError naming `shard:line` for a line that is no record of ours."""
    done = set()
    for path in sorted(p for p in out.iterdir() if SHARD.match(p.name)):
        if not path.is_file():
            raise DamagedOutputError(f"{path} is not a file: remove it, or use another --out")
        lines = path.read_bytes().split(b"\n")
        for lineno, raw in enumerate(lines[:-1], 1):  # lines[-1]: after the last newline
            if raw.strip():
                done.add(_prompt_hash(raw, f"{path}:{lineno}"))
    return done


def _hashed_record(raw: bytes) -> dict | None:
    """The JSON object on line `raw` if it carries a string prompt_hash (what this command
    writes, to the shards and to the failures file), else None."""
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("prompt_hash"), str):
        return None
    return record


def _prompt_hash(raw: bytes, where: str) -> str:
    record = _hashed_record(raw)
    if record is None:
        raise DamagedOutputError(
            f"{where} is not an answer this command wrote: delete that shard (its prompts are "
            "answered again) or use another --out"
        )
    return record["prompt_hash"]


MANIFEST_KEYS = ("target", "sampling")


def read_manifest(out: Path) -> dict | None:
    """OUT's manifest from an earlier run (None when there is none); DamagedOutputError when
    it is not the JSON object a run writes."""
    path = out / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        manifest = None
    ok = isinstance(manifest, dict) and isinstance(manifest.get("sampling"), dict)
    target = manifest.get("target") if ok else None
    if not (isinstance(target, dict) and isinstance(target.get("identity"), str)):
        raise DamagedOutputError(
            f"{path} is damaged (not the JSON object a run writes): the answers beside it "
            "cannot be checked against this target; use another --out, or delete the "
            "directory to answer again"
        )
    return manifest


@contextlib.contextmanager
def writable(out: Path) -> Iterator[None]:
    """An OSError of writing into OUT (a full or read-only disk) as one line: what failed
    and that a rerun resumes."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EIO):
            raise
        raise DamagedOutputError(
            f"{out}: cannot write ({e.strerror}); the answers written so far are kept: free "
            "space or fix the permissions and rerun to resume"
        ) from None


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
    """prompt hash -> its latest failure (a file of earlier runs may repeat a hash). The file
    is only ever replaced whole (`write_failures`), so a line that is no failure record of
    ours is damage: DamagedOutputError naming `path:line`, before anything is written."""
    failed: dict[str, dict] = {}
    if not path.exists():
        return failed
    if not path.is_file():
        raise DamagedOutputError(f"{path} is not a file: remove it, or use another --out")
    for lineno, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        failure = _hashed_record(raw)
        if failure is None:
            raise DamagedOutputError(
                f"{path}:{lineno} is not a failure record this command wrote: delete "
                f"{path.name} (its prompts are not in the shards, so they are answered again; "
                "only their earlier attempt counts are lost) or use another --out"
            )
        failed[failure["prompt_hash"]] = failure
    return failed


def write_failures(path: Path, failed: dict[str, dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(f) + "\n" for f in failed.values()))


class NoPromptsError(UserError):
    """Prompt sources that hold no prompt to answer."""


def no_prompts(sources: list[str], skipped: dict[str, int]) -> None:
    """NoPromptsError: `sources` hold no prompt to answer (`skipped`: why, by reason)."""
    why = ", ".join(f"{n} {reason}" for reason, n in skipped.items())
    raise NoPromptsError(
        f"no prompt to answer in {', '.join(map(str, sources))}"
        + (f" (records skipped: {why})" if why else " (no records)")
        + ": give UTF-8 JSONL records with 'text' or 'messages', or text files"
    )


def valid_records(items, print) -> tuple[list, dict[str, int]]:
    """(the records, {reason: n} of the malformed ones); each malformed one is printed with
    its `file:line` (the first ten, then a count), as distill's reader counts them."""
    # lazy: regenerate's parser imports this module; --help loads no torch
    from specdistill.data.records import DataError

    records, errors = [], []
    for item in items:
        (errors if isinstance(item, DataError) else records).append(item)
    by_reason: dict[str, int] = {}
    for error in errors:
        by_reason[error.reason] = by_reason.get(error.reason, 0) + 1
    if errors:
        reasons = ", ".join(f"{reason}: {n}" for reason, n in by_reason.items())
        print(f"regenerate: skipped {len(errors)} malformed records ({reasons})")
        for error in errors[:10]:
            print(f"regenerate: skipped {error}")
        if len(errors) > 10:
            print(f"regenerate: ... and {len(errors) - 10} more")
    return records, by_reason
