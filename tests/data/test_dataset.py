import json
import logging
from pathlib import Path

import pytest
import torch

from specdistill.data import DataError, DataStats, build_datasets, collate
from specdistill.data.dataset import split_records
from specdistill.data.records import TextRecord
from specdistill.data.stdlib import stdlib_files
from tests.data.helpers import make_tokenizer

DOCS = ["def f(x):\n    return x + 1\n", "hello world", "the quick brown fox", "A"]


def write_docs(folder: Path, docs: list[str]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"doc{i:03d}.txt" for i in range(len(docs))]
    for path, doc in zip(paths, docs, strict=True):
        path.write_text(doc)
    return paths


def jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def stream(tokenizer, docs: list[str]) -> list[int]:
    """Documents' tokens, each followed by EOS, in order."""
    out = []
    for doc in docs:
        out += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return out


def ids(dataset) -> list[list[int]]:
    return [dataset[i]["input_ids"].tolist() for i in range(len(dataset))]


def chat_row(*turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


@pytest.mark.parametrize("max_length", [2, 3, 7, 16, 1000])
def test_packing_cuts_the_document_stream_into_full_blocks(tiny_tokenizer, tmp_path, max_length):
    write_docs(tmp_path / "train", DOCS)
    eval_file = write_docs(tmp_path / "eval", ["hello"])[0]
    train, _ = build_datasets(
        tiny_tokenizer, str(tmp_path / "train"), str(eval_file), max_length=max_length
    )
    expected = stream(tiny_tokenizer, DOCS)
    blocks = ids(train)
    assert all(len(b) == max_length for b in blocks[:-1])
    tail = len(expected) % max_length
    kept = len(expected) - (tail if tail == 1 else 0)  # a 1-token tail holds no prediction
    assert [t for b in blocks for t in b] == expected[:kept]
    assert len(blocks[-1]) == (tail if tail >= 2 else max_length)
    for i in range(len(train)):
        mask = train[i]["loss_mask"]
        assert not mask[0] and mask[1:].all()


def test_eos_separates_documents(tiny_tokenizer, tmp_path):
    write_docs(tmp_path, DOCS)
    train, _ = build_datasets(tiny_tokenizer, str(tmp_path), str(tmp_path), max_length=1000)
    (block,) = ids(train)
    eos = tiny_tokenizer.eos_token_id
    ends = [i for i, t in enumerate(block) if t == eos]
    assert len(ends) == len(DOCS) and ends[-1] == len(block) - 1
    pieces = [block[a + 1 : b] for a, b in zip([-1, *ends], ends, strict=False)]
    assert [tiny_tokenizer.decode(p) for p in pieces] == DOCS


def test_no_packing_truncates_each_record(tiny_tokenizer, tmp_path):
    write_docs(tmp_path, DOCS)
    train, _ = build_datasets(
        tiny_tokenizer, str(tmp_path), str(tmp_path), max_length=6, pack=False
    )
    expected = [stream(tiny_tokenizer, [doc])[:6] for doc in DOCS]
    assert ids(train) == expected
    assert expected[-1] == [*tiny_tokenizer("A")["input_ids"], tiny_tokenizer.eos_token_id]


def test_packed_chat_carries_masks(tiny_tokenizer, tmp_path):
    rows = [
        chat_row(("user", "q"), ("assistant", "the answer")),
        chat_row(("system", "s"), ("user", "hi there"), ("assistant", "hello")),
        chat_row(("user", "why"), ("assistant", "because")),
    ]
    path = jsonl(tmp_path / "chats.jsonl", rows)
    unpacked, _ = build_datasets(tiny_tokenizer, path, path, pack=False, max_length=1000)
    packed, _ = build_datasets(tiny_tokenizer, path, path, pack=True, max_length=9)
    flat_ids = [t for i in range(len(unpacked)) for t in unpacked[i]["input_ids"].tolist()]
    flat_mask = [m for i in range(len(unpacked)) for m in unpacked[i]["loss_mask"].tolist()]
    # Unpacked sequences start with <|im_start|>, never a target, so flat_mask is the
    # records' masks as they were before the first-token rule. Blocks without a target
    # (here: prompt-only stretches) are dropped.
    expected = [
        (flat_ids[i : i + 9], [False, *flat_mask[i + 1 : i + 9]])
        for i in range(0, len(flat_ids), 9)
    ]
    expected = [(x, m) for x, m in expected if any(m)]
    assert len(expected) < len(flat_ids) / 9
    got = [
        (x["input_ids"].tolist(), x["loss_mask"].tolist())
        for x in map(packed.__getitem__, range(len(packed)))
    ]
    assert got == expected
    decoded = tiny_tokenizer.decode(torch.tensor(flat_ids)[torch.tensor(flat_mask)])
    assert decoded == "the answer<|im_end|>hello<|im_end|>because<|im_end|>"


def test_chat_truncation_drops_sequences_without_targets(tiny_tokenizer, tmp_path):
    long_prompt = chat_row(("user", "hello world " * 20), ("assistant", "a"))
    short = chat_row(("user", "q"), ("assistant", "the answer"))
    path = jsonl(tmp_path / "chats.jsonl", [long_prompt, short])
    train, _ = build_datasets(tiny_tokenizer, path, path, pack=False, max_length=40)
    assert train.stats.n_records == 2 and len(train) == 1
    assert (
        tiny_tokenizer.decode(train[0]["input_ids"][train[0]["loss_mask"]])
        == "the answer<|im_end|>"
    )


def test_stats_describe_the_items(tiny_tokenizer, tmp_path):
    path = jsonl(
        tmp_path / "mixed.jsonl",
        [{"text": "hello world"}, chat_row(("user", "q"), ("assistant", "the answer")), "{bad"],
    )
    train, _ = build_datasets(tiny_tokenizer, path, path, max_length=8, skip_malformed=True)
    items = [train[i] for i in range(len(train))]
    assert train.stats == DataStats(
        n_records=2,
        n_skipped=1,
        skipped={"invalid JSON": 1},
        n_sequences=len(items),
        n_tokens=sum(len(it["input_ids"]) for it in items),
        n_loss_tokens=sum(int(it["loss_mask"].sum()) for it in items),
    )
    assert items[0]["input_ids"].dtype == torch.long and items[0]["loss_mask"].dtype == torch.bool


def test_items_are_copies(tiny_tokenizer, tmp_path):
    write_docs(tmp_path, DOCS)
    train, _ = build_datasets(tiny_tokenizer, str(tmp_path), str(tmp_path), max_length=8)
    item = train[0]
    item["input_ids"][:] = 7
    item["loss_mask"][:] = False
    assert train[0]["input_ids"].tolist() != [7] * 8 and train[0]["loss_mask"].any()
    assert train[-1]["input_ids"].tolist() == train[len(train) - 1]["input_ids"].tolist()
    with pytest.raises(IndexError):
        train[len(train)]


def test_held_out_split_is_deterministic_and_disjoint(tiny_tokenizer, tmp_path):
    docs = [f"doc {i:02d}" for i in range(40)]
    write_docs(tmp_path, docs)

    def split(seed):
        train, eval = build_datasets(
            tiny_tokenizer, str(tmp_path), max_length=64, pack=False, seed=seed
        )
        decode = [tiny_tokenizer.decode(x, skip_special_tokens=True) for x in ids(train)]
        held = [tiny_tokenizer.decode(x, skip_special_tokens=True) for x in ids(eval)]
        return decode, held

    train, held = split(seed=0)
    assert len(held) == 2 and sorted(train + held) == docs and not set(train) & set(held)
    assert train == sorted(train) and held == sorted(held)  # source order on each side
    assert split(seed=0) == (train, held)
    assert split(seed=1)[1] != held


def test_split_keeps_a_record_on_each_side():
    records = [TextRecord(str(i), str(i)) for i in range(3)]
    train, held = split_records(records, 0.001, seed=0, label="x")
    assert (len(train), len(held)) == (2, 1)
    train, held = split_records(records, 0.999, seed=0, label="x")
    assert (len(train), len(held)) == (1, 2)


def test_one_record_cannot_be_split(tiny_tokenizer, tmp_path):
    path = write_docs(tmp_path, ["only one"])[0]
    with pytest.raises(DataError, match="1 record.*too few to hold out an eval split"):
        build_datasets(tiny_tokenizer, str(path))


def test_malformed_records_raise_naming_file_and_line(tiny_tokenizer, tmp_path):
    path = jsonl(tmp_path / "chats.jsonl", [{"text": "ok"}, {"text": "ok"}, {"msgs": []}])
    with pytest.raises(DataError, match=f"^{path}:3: missing field"):
        build_datasets(tiny_tokenizer, path)


def test_skip_malformed_counts_and_warns(tiny_tokenizer, tmp_path, caplog):
    good = chat_row(("user", "q"), ("assistant", "the answer"))
    rows = [good, "{not json", {"text": 3}, good, chat_row(("robot", "x")), good]
    path = jsonl(tmp_path / "chats.jsonl", rows)
    eval_path = jsonl(tmp_path / "eval.jsonl", [good, "[1, 2]"])
    with caplog.at_level(logging.WARNING, logger="specdistill.data"):
        train, eval = build_datasets(tiny_tokenizer, path, eval_path, skip_malformed=True)
    assert (train.stats.n_records, train.stats.n_skipped) == (3, 3)
    assert (eval.stats.n_records, eval.stats.n_skipped) == (1, 1)
    assert train.stats.skipped == {"invalid JSON": 1, "text not a string": 1, "unknown role": 1}
    assert eval.stats.skipped == {"not a JSON object": 1}
    assert (
        "skipped 3 malformed records (invalid JSON: 1, text not a string: 1, unknown role: 1), "
        f"e.g. {path}:2: malformed JSON"
    ) in caplog.text


def test_skips_at_reading_and_tokenising_make_one_total(tiny_tokenizer, tmp_path, caplog):
    good = chat_row(("user", "q"), ("assistant", "the answer"))
    starts_with_assistant = chat_row(("assistant", "hi"), ("user", "q"))
    rows = ["{bad", good, starts_with_assistant, "[]", good, starts_with_assistant, "{", good]
    path = jsonl(tmp_path / "chats.jsonl", rows)
    eval_path = jsonl(tmp_path / "eval.jsonl", [good, starts_with_assistant])
    with caplog.at_level(logging.WARNING, logger="specdistill.data"):
        train, eval = build_datasets(tiny_tokenizer, path, eval_path, skip_malformed=True)
    assert train.stats.skipped == {
        "invalid JSON": 2,
        "starts with assistant": 2,
        "not a JSON object": 1,
    }
    assert (train.stats.n_records, train.stats.n_skipped) == (3, 5)
    assert eval.stats.skipped == {"starts with assistant": 1}
    assert (eval.stats.n_records, eval.stats.n_skipped) == (1, 1)
    # One warning per dataset, with the total and the reasons.
    warnings = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(warnings) == 2
    assert warnings[0].startswith(
        f"train data ({path}): skipped 5 malformed records (invalid JSON: 2, "
        f"starts with assistant: 2, not a JSON object: 1), e.g. {path}:1: malformed JSON"
    )
    assert warnings[1].startswith(
        f"eval data ({eval_path}): skipped 1 malformed records (starts with assistant: 1), "
        f"e.g. {eval_path}:2: the conversation starts"
    )


def test_held_out_split_counts_skips_on_the_train_side(tiny_tokenizer, tmp_path):
    path = jsonl(tmp_path / "docs.jsonl", [{"text": f"doc {i}"} for i in range(10)] + ["{"])
    train, eval = build_datasets(tiny_tokenizer, path, skip_malformed=True, eval_fraction=0.5)
    assert train.stats.skipped == {"invalid JSON": 1} and train.stats.n_skipped == 1
    assert eval.stats.skipped == {} and eval.stats.n_skipped == 0


def test_nothing_skipped_without_errors(tiny_tokenizer, tmp_path):
    write_docs(tmp_path, DOCS)
    train, eval = build_datasets(tiny_tokenizer, str(tmp_path), str(tmp_path), skip_malformed=True)
    assert train.stats.skipped == eval.stats.skipped == {}


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ("{", "invalid JSON"),
        ("3", "not a JSON object"),
        ({"txt": "x"}, "no text or messages"),
        ({"text": ["x"]}, "text not a string"),
        (chat_row(("robot", "x")), "unknown role"),
        ({"messages": [{"role": "user"}]}, "malformed record"),
        ({"messages": []}, "malformed record"),
    ],
)
def test_reasons_of_malformed_rows(tiny_tokenizer, tmp_path, row, reason):
    good = {"text": "hello"}
    path = jsonl(tmp_path / "rows.jsonl", [good, row, good])
    train, _ = build_datasets(tiny_tokenizer, path, path, skip_malformed=True)
    assert train.stats.skipped == {reason: 1}


def test_nothing_left_after_skipping(tiny_tokenizer, tmp_path):
    path = jsonl(tmp_path / "bad.jsonl", ["{", {"txt": "x"}])
    with pytest.raises(DataError, match="train data .*: no records"):
        build_datasets(tiny_tokenizer, path, skip_malformed=True)


def test_skip_malformed_covers_records_the_template_rejects(tiny_tokenizer, tmp_path):
    good = chat_row(("user", "q"), ("assistant", "the answer"))
    path = jsonl(tmp_path / "chats.jsonl", [good, chat_row(("assistant", "hi")), good])
    with pytest.raises(DataError, match=f"^{path}:2: the conversation starts with an assistant"):
        build_datasets(tiny_tokenizer, path, path)
    train, _ = build_datasets(tiny_tokenizer, path, path, skip_malformed=True)
    assert (train.stats.n_records, train.stats.n_skipped) == (2, 1)
    assert train.stats.skipped == {"starts with assistant": 1}


def test_no_loss_tokens_after_masking(tiny_tokenizer, tmp_path):
    rows = [chat_row(("system", "s"), ("user", "q")), chat_row(("user", "hello"))]
    path = jsonl(tmp_path / "prompts.jsonl", rows)
    with pytest.raises(DataError, match="no loss tokens after masking: train data"):
        build_datasets(tiny_tokenizer, path, path)


def test_chat_data_needs_a_chat_template(tmp_path):
    path = jsonl(tmp_path / "chats.jsonl", [chat_row(("user", "q"), ("assistant", "a"))])
    with pytest.raises(DataError, match="set tokenizer.chat_template"):
        build_datasets(make_tokenizer(chat_template=None), path, path)


def test_sources_may_mix_globs_files_and_lists(tiny_tokenizer, tmp_path):
    write_docs(tmp_path / "a", DOCS[:2])
    write_docs(tmp_path / "b", DOCS[2:])
    train, eval = build_datasets(
        tiny_tokenizer,
        [f"{tmp_path}/a/*.txt", str(tmp_path / "b" / "doc000.txt")],
        [f"{tmp_path}/**/doc001.txt"],
        max_length=1000,
        pack=False,
    )
    assert ids(train) == [stream(tiny_tokenizer, [d]) for d in DOCS[:3]]
    assert ids(eval) == [stream(tiny_tokenizer, [d]) for d in (DOCS[1], DOCS[3])]


def test_missing_source_is_named(tiny_tokenizer, tmp_path):
    with pytest.raises(DataError, match="corpus.jsonl: no such file or directory"):
        build_datasets(tiny_tokenizer, str(tmp_path / "corpus.jsonl"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_length": 1}, "max_length must be >= 2"), ({"eval_fraction": 1.0}, "eval_fraction")],
)
def test_bad_arguments(tiny_tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_datasets(tiny_tokenizer, "embedded:code-heldout", **kwargs)


def test_embedded_heldout_corpus(tiny_tokenizer):
    train, eval = build_datasets(tiny_tokenizer, "embedded:code-heldout", max_length=256)
    files = [p for p in stdlib_files("heldout") if p.read_text(encoding="utf-8")]
    assert train.stats.n_records + eval.stats.n_records == len(files)
    assert eval.stats.n_records == round(0.05 * len(files))
    assert all(len(train[i]["input_ids"]) == 256 for i in range(len(train) - 1))
    first = tiny_tokenizer.decode(train[0]["input_ids"])
    assert any(p.read_text(encoding="utf-8").startswith(first) for p in files)


def test_collate_right_pads():
    batch = [
        {"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.tensor([False, True, True])},
        {"input_ids": torch.tensor([8, 9]), "loss_mask": torch.tensor([False, True])},
    ]
    out = collate(batch, pad_token_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert out["loss_mask"].tolist() == [[False, True, True], [False, True, False]]
    assert out["input_ids"].dtype == torch.long and out["attention_mask"].dtype == torch.long
    assert out["loss_mask"].dtype == torch.bool
    with pytest.raises(ValueError, match="pad_token_id is None"):
        collate(batch, pad_token_id=None)
