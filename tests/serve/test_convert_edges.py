"""`specdistill convert-traffic` on hostile and damaged inputs: every bad line or file is one
counted reject naming where it is, the good ones are converted, nothing is appended twice."""

import copy
import json
import math
import pickle

import pytest

from specdistill.formats.traffic_shards import read_traffic
from specdistill.serve.convert import convert
from tests.serve.helpers import GenerateReqInput, vllm_lines


def _completion(tokenizer, i: int, prompt: str = "def add(a, b):\n", **request) -> dict:
    line = copy.deepcopy(vllm_lines(tokenizer)[0])  # its statistics are a shared dict
    line["request"] = {**line["request"], "prompt": prompt, **request}
    line["response"] = {**line["response"], "id": f"cmpl-{i}"}
    return line


def _rejects(out) -> list[dict]:
    return [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]


def test_a_non_object_line_is_a_counted_reject_not_a_crash(traffic_target, tmp_path):
    _, tokenizer, identity = traffic_target
    source = tmp_path / "proxy.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    lines = [json.dumps(_completion(tokenizer, 1)), "[1, 2, 3]", deep, "7"]
    lines.append(json.dumps(_completion(tokenizer, 2)))
    source.write_text("\n".join(lines) + "\n")
    result = convert("vllm", [source], tokenizer, identity, tmp_path / "t")
    assert result["converted"] == 2
    assert result["rejected"] == {
        "a line must be a JSON object, got list": 1,
        "invalid JSON": 1,
        "a line must be a JSON object, got int": 1,
    }
    assert [r["source"] for r in _rejects(tmp_path / "t")] == [
        f"{source}:2",
        f"{source}:3",
        f"{source}:4",
    ]
    assert [r["id"] for r in read_traffic(tmp_path / "t")] == ["cmpl-1", "cmpl-2"]


def test_unicode_line_separators_inside_strings_do_not_split_lines(traffic_target, tmp_path):
    _, tokenizer, identity = traffic_target
    source = tmp_path / "proxy.jsonl"
    separators = ["\u2028", "\u2029", "\u0085", "\u001c", "\u000b"]
    lines = [
        json.dumps(_completion(tokenizer, i, prompt=f"x = 1{sep}y = 2\n"), ensure_ascii=False)
        for i, sep in enumerate(separators)
    ]
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = convert("vllm", [source], tokenizer, identity, tmp_path / "t")
    assert result["converted"] == 5 and result["rejected"] == {}
    prompts = [r["prompt"] for r in read_traffic(tmp_path / "t")]
    assert prompts == [f"x = 1{sep}y = 2\n" for sep in separators]


def test_a_line_that_is_not_utf8_is_rejected_alone(traffic_target, tmp_path):
    _, tokenizer, identity = traffic_target
    source = tmp_path / "proxy.jsonl"
    good = [json.dumps(_completion(tokenizer, i)).encode() for i in (1, 2)]
    source.write_bytes(good[0] + b"\n" + b'{"request": "\xff\xfe"}\n' + good[1] + b"\n")
    result = convert("vllm", [source], tokenizer, identity, tmp_path / "t")
    assert result["converted"] == 2
    assert result["rejected"] == {"not UTF-8": 1}
    (reject,) = _rejects(tmp_path / "t")
    assert reject["source"] == f"{source}:2" and "invalid start byte at byte 13" in reject["reason"]


@pytest.mark.parametrize(
    "request_fields, reason",
    [
        ({"temperature": math.nan}, "temperature must be a finite number >= 0, got nan"),
        ({"temperature": math.inf}, "temperature must be a finite number >= 0, got inf"),
        ({"temperature": -1}, "temperature must be a finite number >= 0, got -1"),
        ({"top_p": 5}, "top_p must be in (0, 1], got 5.0"),
        ({"top_p": -math.inf}, "top_p must be a finite number, got -inf"),
        ({"max_tokens": -3}, "max_tokens must be a non-negative integer, got -3"),
        ({"max_tokens": 1e400}, "max_tokens must be a non-negative integer, got inf"),
        ({"seed": 1.5}, "seed must be an integer, got 1.5"),
    ],
)
def test_non_finite_and_out_of_range_sampling_is_rejected(
    traffic_target, tmp_path, request_fields, reason
):
    _, tokenizer, identity = traffic_target
    source = tmp_path / "proxy.jsonl"
    bad = json.dumps(_completion(tokenizer, 2, **request_fields))  # NaN, Infinity as Python's
    source.write_text(json.dumps(_completion(tokenizer, 1)) + "\n" + bad + "\n")
    result = convert("vllm", [source], tokenizer, identity, tmp_path / "t")
    assert result["converted"] == 1 and sum(result["rejected"].values()) == 1
    (reject,) = _rejects(tmp_path / "t")
    assert reject == {"source": f"{source}:2", "reason": reason}
    (record,) = read_traffic(tmp_path / "t")
    assert record["id"] == "cmpl-1"


def test_non_finite_speculative_statistics_are_rejected(traffic_target, tmp_path):
    _, tokenizer, identity = traffic_target
    line = _completion(tokenizer, 1)
    line["response"]["metrics"]["speculative_decoding"]["num_draft_tokens"] = math.nan
    source = tmp_path / "proxy.jsonl"
    source.write_text(json.dumps(line) + "\n")
    result = convert("vllm", [source], tokenizer, identity, tmp_path / "t")
    assert result["converted"] == 0
    assert (
        "num_draft_tokens must be a non-negative integer, got nan"
        in _rejects(tmp_path / "t")[0]["reason"]
    )


def test_converting_twice_appends_each_record_once(traffic_target, tmp_path):
    """Idempotent by record key (id, prompt ids, completion ids) against OUT's traffic log."""
    _, tokenizer, identity = traffic_target
    out = tmp_path / "t"
    first = tmp_path / "a.jsonl"
    first.write_text("\n".join(json.dumps(_completion(tokenizer, i)) for i in (1, 2)) + "\n[1]\n")
    result = convert("vllm", [first], tokenizer, identity, out)
    assert result["converted"] == 2, result
    again = convert("vllm", [first], tokenizer, identity, out)
    assert again["converted"] == 0 and again["already_logged"] == 2
    assert sum(again["rejected"].values()) == 1  # counted again, written once
    assert len(_rejects(out)) == 1
    # a grown log (one old record, one new) and an entry without an id, twice
    no_id = _completion(tokenizer, 9)
    del no_id["response"]["id"]
    grown = tmp_path / "b.jsonl"
    grown.write_text(
        "\n".join(json.dumps(x) for x in (_completion(tokenizer, 2), _completion(tokenizer, 3)))
        + "\n"
        + json.dumps(no_id)
        + "\n"
    )
    assert convert("vllm", [grown], tokenizer, identity, out)["converted"] == 2
    assert convert("vllm", [grown, first], tokenizer, identity, out)["converted"] == 0
    ids = [r["id"] for r in read_traffic(out)]
    assert len(ids) == len(set(ids)) == 4
    assert ids[:3] == ["cmpl-1", "cmpl-2", "cmpl-3"] and ids[3].startswith("vllm-")
    assert len(list(out.glob("traffic-*.jsonl"))) == 2  # runs that add nothing open no shard


def test_bad_pickles_are_rejected_and_the_good_ones_converted(traffic_target, tmp_path):
    _, tokenizer, identity = traffic_target
    folder = tmp_path / "dump"
    folder.mkdir()
    out_ids = tokenizer.encode("return x", add_special_tokens=False)
    good = [
        (
            GenerateReqInput("def f(x):\n", {"temperature": 1.0, "max_new_tokens": 8}),
            {"text": "return x", "output_ids": out_ids, "meta_info": {"id": "s1"}},
        )
    ]
    # a class, called, then its instance called: `'AttrBag' object is not callable`
    (folder / "a_calls_an_instance.pkl").write_bytes(b"cos\nsystem\n(tR(S'x'\ntR.")
    (folder / "b_good.pkl").write_bytes(pickle.dumps(good))
    (folder / "c_truncated.pkl").write_bytes(pickle.dumps(good)[:-12])
    depth = 100_000  # pushed flat, appended into each other: no recursion while loading
    (folder / "d_deep.pkl").write_bytes(b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b".")
    (folder / "e_self_reference.pkl").write_bytes(b"\x80\x02]q\x00h\x00a.")  # l = [l]
    (folder / "f_not_a_pickle.pkl").write_bytes(b"\xff\xfe garbage")
    inputs = sorted(folder.iterdir())
    result = convert("sglang", inputs, tokenizer, identity, tmp_path / "t")
    assert result["converted"] == 1
    assert result["rejected"] == {
        "unreadable dump: TypeError: 'AttrBag' object is not callable": 1,
        "unreadable dump: UnpicklingError: pickle data was truncated": 1,
        "unreadable dump: nested deeper than 64 levels": 2,  # 100,000 deep; l = [l]
        "unreadable dump: UnpicklingError: invalid load key, '\\xff'.": 1,
    }
    sources = [r["source"] for r in _rejects(tmp_path / "t")]
    assert sources == [str(p) for p in inputs if "good" not in p.name]
    (record,) = read_traffic(tmp_path / "t")
    assert record["id"] == "s1" and record["completion_token_ids"] == out_ids


def test_sglang_json_lines_that_are_not_objects_are_rejected(traffic_target, tmp_path):
    _, tokenizer, identity = traffic_target
    source = tmp_path / "gen.jsonl"
    good = {"request": {"text": "a", "rid": "r1"}, "output": {"text": "b", "meta_info": {}}}
    source.write_text("[1, 2, 3]\n" + json.dumps(good) + "\n")
    result = convert("sglang", [source], tokenizer, identity, tmp_path / "t")
    assert result["converted"] == 1
    assert result["rejected"] == {"a line must be a JSON object, got list": 1}
