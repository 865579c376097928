import json
import re
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specdistill.data.records import ChatRecord, DataError, TextRecord
from specdistill.data.sources import HubDataset, read_records, resolve
from specdistill.data.stdlib import help_topics, stdlib_files, stdlib_prose


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def jsonl(path: Path, rows: list) -> Path:
    return write(path, "".join(json.dumps(r) + "\n" for r in rows))


def test_directory_takes_known_extensions_recursively_sorted_and_skips_hidden(tmp_path):
    for name in ["b.py", "a.txt", "sub/c.md", "sub/d.jsonl", "e.bin", ".hidden/f.py", "g.png"]:
        write(tmp_path / name, "x")
    assert resolve(str(tmp_path)) == [
        tmp_path / "a.txt",
        tmp_path / "b.py",
        tmp_path / "sub/c.md",
        tmp_path / "sub/d.jsonl",
    ]


def test_directory_without_data_files(tmp_path):
    write(tmp_path / "x.bin", "x")
    with pytest.raises(DataError, match="directory has no data files"):
        resolve(str(tmp_path))


def test_recursive_glob(tmp_path):
    for name in ["corpus/a.py", "corpus/pkg/b.py", "corpus/pkg/c.txt", "other/d.py"]:
        write(tmp_path / name, "x")
    assert resolve(f"{tmp_path}/corpus/**/*.py") == [
        tmp_path / "corpus/a.py",
        tmp_path / "corpus/pkg/b.py",
    ]


def test_glob_matching_nothing_names_it(tmp_path):
    source = f"{tmp_path}/corpus/**/*.py"
    with pytest.raises(DataError, match=re.escape(f"{source}: glob matched no files")):
        resolve(source)


@pytest.mark.parametrize(
    "name", ["corpus/train.jsonl", "./missing", "../missing", "/no/such/dir/file"]
)
def test_missing_path_names_it(name):
    with pytest.raises(DataError, match=re.escape(f"{name}: no such file or directory")):
        resolve(name)


@pytest.mark.parametrize(
    ("source", "hub"),
    [
        ("org/name", HubDataset("org/name", "train")),
        ("org/name:test", HubDataset("org/name", "test")),
        ("org/my.data-v2:train[:100]", HubDataset("org/my.data-v2", "train[:100]")),
    ],
)
def test_hub_ids(source, hub):
    assert resolve(source) == [hub]


def test_existing_path_wins_over_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "org/name", "a document")
    assert resolve("org/name") == [Path("org/name")]


def test_embedded_corpora():
    assert resolve("embedded:code-heldout") == stdlib_files("heldout")
    assert resolve("embedded:code") == stdlib_files("train")
    with pytest.raises(DataError, match="unknown embedded corpus 'embedded:poetry'"):
        resolve("embedded:poetry")


def test_embedded_prose_is_english_from_both_sides_of_the_code_split():
    train, heldout = stdlib_prose("train"), stdlib_prose("heldout")
    assert len(train) > 300 and len(heldout) > 20
    assert not set(train) & set(heldout)
    assert sum(map(len, train)) > 5 * sum(map(len, heldout))
    # docstrings, not code: no line of a module's document is a def or an import
    modules = train[:50]
    assert not any(line.startswith(("def ", "import ")) for d in modules for line in d.split("\n"))
    fine_tune, held_topics = help_topics()
    assert train[-len(fine_tune) :] == tuple(fine_tune)
    assert heldout[-len(held_topics) :] == tuple(held_topics)
    records = list(read_records(["embedded:prose-heldout"]))
    assert records[1].origin == "embedded:prose-heldout[1]"
    assert records[0].text == heldout[0]


def test_text_files_are_one_record_each_and_empty_ones_are_ignored(tmp_path):
    write(tmp_path / "a.py", "x = 1\n")
    write(tmp_path / "b.txt", "")
    write(tmp_path / "c.md", "# title\n")
    assert list(read_records([str(tmp_path)])) == [
        TextRecord("x = 1\n", str(tmp_path / "a.py")),
        TextRecord("# title\n", str(tmp_path / "c.md")),
    ]


def test_jsonl_errors_name_file_and_line(tmp_path):
    path = tmp_path / "chats.jsonl"
    lines = [
        json.dumps({"text": "fine"}),
        "",  # blank lines are skipped but still counted
        '{"text": "unterminated',
        json.dumps({"message": []}),
        json.dumps({"messages": [{"role": "bot", "content": "x"}]}),
        json.dumps({"messages": []}),
        json.dumps({"text": ["not", "a", "string"]}),
        json.dumps({"conversations": [{"from": "human", "value": "q"}]}),
    ]
    write(path, "\n".join(lines) + "\n")
    items = list(read_records([str(path)]))
    assert items[0] == TextRecord("fine", f"{path}:1")
    errors = [str(e) for e in items[1:-1]]
    assert all(isinstance(e, DataError) for e in items[1:-1])
    assert errors[0].startswith(f"{path}:3: malformed JSON")
    assert errors[1].startswith(f"{path}:4: missing field")
    assert errors[2].startswith(f"{path}:5: messages[0]: unknown role 'bot'")
    assert errors[3] == f"{path}:6: 'messages' is an empty list"
    assert errors[4] == f"{path}:7: 'text' must be a string, got list"
    assert items[-1] == ChatRecord([{"role": "user", "content": "q"}], f"{path}:8")


def test_invalid_utf8(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"ok \xff\xfe")
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "\xff"}\n')
    items = list(read_records([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]))
    assert str(items[0]).startswith(f"{tmp_path / 'a.txt'}: not UTF-8 text")
    assert items[1] == TextRecord("fine", f"{tmp_path / 'b.jsonl'}:1")
    assert str(items[2]).startswith(f"{tmp_path / 'b.jsonl'}:2: not UTF-8")


def test_json_list(tmp_path):
    path = write(tmp_path / "rows.json", json.dumps([{"text": "a"}, {"txt": "b"}]))
    first, second = read_records([str(path)])
    assert first == TextRecord("a", f"{path}[0]")
    assert str(second).startswith(f"{path}[1]: missing field")


@pytest.mark.parametrize(
    ("content", "problem"),
    [('{"text": "a"}', "must hold a list of records, got dict"), ("[\n{]", ":2: malformed JSON")],
)
def test_bad_json_file(tmp_path, content, problem):
    path = write(tmp_path / "rows.json", content)
    (error,) = read_records([str(path)])
    assert isinstance(error, DataError) and problem in str(error)


def test_parquet(tmp_path):
    path = tmp_path / "rows.parquet"
    table = pa.table({"text": ["a", None], "messages": [None, [{"role": "user", "content": "q"}]]})
    pq.write_table(table, path)
    assert list(read_records([str(path)])) == [
        TextRecord("a", f"{path}[row 0]"),
        ChatRecord([{"role": "user", "content": "q"}], f"{path}[row 1]"),
    ]


def test_hub_dataset_rows(monkeypatch):
    calls = []

    def load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list(
            [
                {"id": 1, "conversations": [{"from": "human", "value": "q"}]},
                {"id": 2, "conversations": [{"from": "robot", "value": "a"}]},
            ]
        )

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    first, second = read_records(["org/chats:test"])
    assert calls == [("org/chats", "test")]
    assert first == ChatRecord([{"role": "user", "content": "q"}], "org/chats:test[0]")
    assert str(second).startswith("org/chats:test[1]: conversations[0]: unknown role 'robot'")


def test_hub_dataset_without_record_columns(monkeypatch):
    monkeypatch.setattr(
        datasets, "load_dataset", lambda name, split: datasets.Dataset.from_list([{"body": "x"}])
    )
    with pytest.raises(DataError, match=r"org/x:train: no 'text', .* column \(columns: body\)"):
        list(read_records(["org/x"]))


def test_hub_dataset_failure_is_explained(monkeypatch):
    def offline(name, split):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError) as info:
        list(read_records(["org/missing"]))
    message = str(info.value)
    assert message.startswith("org/missing:train: not a local path")
    assert "Couldn't reach 'org/missing'" in message and "offline" in message


def test_all_sources_resolve_before_reading(tmp_path, monkeypatch):
    def never(name, split):
        raise AssertionError("read before the missing source was reported")

    monkeypatch.setattr(datasets, "load_dataset", never)
    with pytest.raises(DataError, match="no such file"):
        list(read_records(["org/name", str(tmp_path / "missing.jsonl")]))
