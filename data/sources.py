"""Source strings → records.

A source string is, checked in this order:

    embedded:code / embedded:code-heldout   the standard-library corpus (data/stdlib.py)
    embedded:prose / embedded:prose-heldout its docstrings and help topics (English)
    an existing file                        read by extension (below)
    an existing directory                   its files with a known extension, recursively,
                                            skipping hidden files and folders
    org/name or org/name:split              a Hugging Face dataset (split defaults to
                                            "train"; "train[:1000]" works), loaded with
                                            `datasets.load_dataset`, when no such path exists
    a glob (corpus/**/*.py)                 every matching file, read by extension

File kinds: `.jsonl` (one row per line), `.json` (a list of rows), `.parquet` (one row per
table row); any other file is one plain-text document (for directories only `.py`, `.txt`
and `.md` are taken). Rows are checked by `records.record_from_row`.

Local rows are parsed here line by line, so a malformed one is reported as `path:line`.
Reading never raises for a malformed row: it yields the DataError in the record's place
and the caller decides whether to skip it. A source that cannot be found or opened raises.
"""

import glob
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from specdistill.data.instructions import stdlib_instructions
from specdistill.data.records import DataError, Record, record_from_row
from specdistill.data.stdlib import stdlib_files, stdlib_prose

TEXT_SUFFIXES = (".py", ".txt", ".md")
ROW_SUFFIXES = (".jsonl", ".json", ".parquet")
ROW_FIELDS = ("text", "messages", "conversations")
EMBEDDED = {
    "embedded:code": ("code", "train"),
    "embedded:code-heldout": ("code", "heldout"),
    "embedded:prose": ("prose", "train"),
    "embedded:prose-heldout": ("prose", "heldout"),
    "embedded:instructions": ("instructions", "train"),
    "embedded:instructions-heldout": ("instructions", "heldout"),
}

_HUB_ID = re.compile(r"([\w-][\w.-]*/[\w-][\w.-]*)(?::(\S+))?")
_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class HubDataset:
    name: str
    split: str


@dataclass(frozen=True)
class Documents:
    """An embedded corpus that is not a set of files: its documents, in a fixed order; with
    `chat`, each is a user turn to be answered (a chat record without an answer)."""

    source: str
    texts: tuple[str, ...]
    chat: bool = False


def resolve(source: str) -> list[Path | HubDataset | Documents]:
    """What `source` names: files in a fixed (sorted) order, one Hub dataset, or documents."""
    if source.startswith("embedded:"):
        if source not in EMBEDDED:
            raise DataError(f"unknown embedded corpus {source!r} (known: {', '.join(EMBEDDED)})")
        kind, split = EMBEDDED[source]
        if kind == "prose":
            return [Documents(source, stdlib_prose(split))]
        if kind == "instructions":
            return [Documents(source, stdlib_instructions(split), chat=True)]
        return list(stdlib_files(split))
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = [
            p
            for p in sorted(path.rglob("*"))
            if p.is_file()
            and p.suffix.lower() in TEXT_SUFFIXES + ROW_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        ]
        if not files:
            raise DataError(
                f"{source}: directory has no data files "
                f"(looked for {', '.join(TEXT_SUFFIXES + ROW_SUFFIXES)})"
            )
        return files
    hub = _HUB_ID.fullmatch(source)
    if hub and not source.lower().endswith(TEXT_SUFFIXES + ROW_SUFFIXES):
        return [HubDataset(hub.group(1), hub.group(2) or "train")]
    if any(c in source for c in _GLOB_CHARS):
        files = sorted(Path(p) for p in glob.glob(source, recursive=True) if Path(p).is_file())
        if not files:
            raise DataError(f"{source}: glob matched no files")
        return files
    raise DataError(f"{source}: no such file or directory")


def read_records(sources: list[str]) -> Iterator[Record | DataError]:
    """Every record of `sources` in order; a malformed row is yielded as its DataError.

    All sources are resolved before any is read, so a missing one fails fast.
    """
    items = [item for source in sources for item in resolve(source)]
    for item in items:
        if isinstance(item, HubDataset):
            yield from _read_hub(item)
        elif isinstance(item, Documents):
            for i, text in enumerate(item.texts):
                row = (
                    {"messages": [{"role": "user", "content": text}]}
                    if item.chat
                    else {"text": text}
                )
                yield from _row(row, f"{item.source}[{i}]")
        else:
            yield from read_file(item)


def read_file(path: Path) -> Iterator[Record | DataError]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _read_jsonl(path)
    elif suffix == ".json":
        yield from _read_json(path)
    elif suffix == ".parquet":
        yield from _read_parquet(path)
    else:
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            yield DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})")
            return
        record = record_from_row({"text": text}, str(path))
        if record is not None:
            yield record


def _read_jsonl(path: Path) -> Iterator[Record | DataError]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            origin = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                yield DataError(f"{origin}: not UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                yield DataError(f"{origin}: malformed JSON ({exc.msg} at column {exc.colno})")
                continue
            except RecursionError:
                yield DataError(f"{origin}: malformed JSON (nested too deeply)")
                continue
            yield from _row(row, origin)


def _read_json(path: Path) -> Iterator[Record | DataError]:
    try:
        rows = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        yield DataError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})")
        return
    except json.JSONDecodeError as exc:
        yield DataError(f"{path}:{exc.lineno}: malformed JSON ({exc.msg} at column {exc.colno})")
        return
    except RecursionError:
        yield DataError(f"{path}: malformed JSON (nested too deeply)")
        return
    if not isinstance(rows, list):
        yield DataError(
            f"{path}: a .json data file must hold a list of records, got {type(rows).__name__}"
            " (use .jsonl for one record per line)"
        )
        return
    for i, row in enumerate(rows):
        yield from _row(row, f"{path}[{i}]")


def _read_parquet(path: Path) -> Iterator[Record | DataError]:
    table = pq.read_table(path)
    columns = _row_columns(table.column_names, str(path))
    for i, row in enumerate(table.select(columns).to_pylist()):
        yield from _row(row, f"{path}[row {i}]")


def _read_hub(hub: HubDataset) -> Iterator[Record | DataError]:
    import datasets  # lazy: slow to import; only a hub dataset needs it

    label = f"{hub.name}:{hub.split}"
    try:
        dataset = datasets.load_dataset(hub.name, split=hub.split)
    except Exception as exc:
        raise DataError(
            f"{label}: not a local path, so it was read as a Hugging Face dataset id, and "
            f"loading it failed ({type(exc).__name__}: {exc}). Check the path or the id; "
            "offline, download the dataset beforehand or pass a local file."
        ) from exc
    dataset = dataset.select_columns(_row_columns(dataset.column_names, label))
    for i, row in enumerate(dataset):
        yield from _row(row, f"{label}[{i}]")


def _row_columns(columns: list[str], label: str) -> list[str]:
    present = [c for c in ROW_FIELDS if c in columns]
    if not present:
        raise DataError(
            f"{label}: no 'text', 'messages' or 'conversations' column "
            f"(columns: {', '.join(columns)})"
        )
    return present


def _row(row: object, origin: str) -> Iterator[Record | DataError]:
    try:
        record = record_from_row(row, origin)
    except DataError as exc:
        yield exc
        return
    if record is not None:
        yield record
