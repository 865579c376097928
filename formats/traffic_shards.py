"""The traffic log's shards: DIR/traffic-000001.jsonl, DIR/traffic-000002.jsonl, ... one
traffic record (formats/traffic.py) per line, numbered in the order they were opened.

A writer appends each line whole (serve/traffic.py `TrafficLog`), so a crash leaves at most
one torn *final* line, never a torn line in the middle; the readers skip a shard's final line
without its newline.
"""

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from specdistill.formats.traffic import TrafficError, TrafficRecord, parse_record, validate

SHARD = re.compile(r"^traffic-(\d{6})\.jsonl$")  # `shard_name`


def shard_name(index: int) -> str:
    """The name of shard `index` (1 -> "traffic-000001.jsonl")."""
    return f"traffic-{index:06d}.jsonl"


def shard_index(name: str) -> int | None:
    """The number of the shard called `name`, or None when it is not a shard's name."""
    match = SHARD.match(name)
    return int(match[1]) if match else None


def shards(directory: str | os.PathLike) -> list[Path]:
    """The shard files of DIR in order."""
    d = Path(directory)
    return sorted((p for p in d.iterdir() if shard_index(p.name) is not None), key=lambda p: p.name)


def complete_lines(directory: str | os.PathLike) -> Iterator[tuple[Path, int, bytes]]:
    """(shard, line number, bytes) of every complete, non-blank line of DIR's shards, in
    order; a shard's final line without its newline (a write cut short) is skipped."""
    for path in shards(directory):
        lines = path.read_bytes().split(b"\n")
        for number, raw in enumerate(lines[:-1], 1):  # lines[-1]: after the last newline
            if raw.strip():
                yield path, number, raw


def _read(directory, parse: Callable[[dict], object]) -> list:
    found = []
    for path, number, raw in complete_lines(directory):
        try:
            found.append(parse(json.loads(raw)))
        except (json.JSONDecodeError, UnicodeDecodeError, TrafficError) as e:
            raise TrafficError(f"{path}:{number}: {e}") from e
    return found


def read_traffic(directory: str | os.PathLike) -> list[dict]:
    """Every record of DIR's shards as the JSON object its line holds, in order, each
    validated (TrafficError names the file and line of the first bad one)."""
    return _read(directory, validate)


def read_records(directory: str | os.PathLike) -> list[TrafficRecord]:
    """Every record of DIR's shards as a `TrafficRecord`, in order (the checks and errors of
    `read_traffic`)."""
    return _read(directory, parse_record)
