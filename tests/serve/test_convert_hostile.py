"""`specdistill convert-traffic` on hostile inputs: a lone surrogate, `top_p: 0`, a chat
message or reply that is not text, an empty completion and a pickle that asks for a huge
buffer are each one counted reject (the rest converted, reruns too); an --out that is a file
is one line and kept."""

import copy
import json
import pickle
import tracemalloc

import pytest

from specdistill.errors import run_guarded
from specdistill.formats.traffic_shards import read_traffic
from specdistill.serve.convert import convert
from specdistill.serve.convert_cli import main
from tests.serve.helpers import GenerateReqInput, vllm_lines


def _lines(tokenizer, *edits) -> list[dict]:
    """The completion line of `vllm_lines` (id cmpl-0), then one copy per edit (cmpl-1, ...),
    each edit a function of the copy."""
    base = vllm_lines(tokenizer)[0]
    base["response"]["id"] = "cmpl-0"
    out = [copy.deepcopy(base)]
    for i, edit in enumerate(edits, 1):
        line = copy.deepcopy(base)
        line["response"]["id"] = f"cmpl-{i}"
        edit(line)
        out.append(line)
    return out


def _write(path, lines) -> None:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def _set(line: dict, *keys, value) -> None:
    for key in keys[:-1]:
        line = line[key]
    line[keys[-1]] = value


def test_a_lone_surrogate_is_a_counted_reject_and_later_lines_convert(traffic_target, tmp_path):
    _, tokenizer, identity = traffic_target
    source = tmp_path / "proxy.jsonl"
    lines = _lines(tokenizer, lambda x: _set(x, "request", "prompt", value="a\ud800b"), id)
    lines[2]["response"]["id"] = "cmpl-2"  # the last one unedited, after the bad one
    _write(source, lines)
    out = tmp_path / "traffic"
    for run in (1, 2):  # a rerun meets the same line and goes on as well
        result = convert("vllm", [source], tokenizer, identity, out)
        assert result["rejected"] == {"a string holds a lone surrogate": 1}
        assert (result["converted"], result["already_logged"]) == ((2, 0) if run == 1 else (0, 2))
    assert [r["id"] for r in read_traffic(out)] == ["cmpl-0", "cmpl-2"]
    (reject,) = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert reject["source"] == f"{source}:2"


def test_top_p_0_is_rejected_not_rewritten(traffic_target, tmp_path):
    _, tokenizer, identity = traffic_target
    source = tmp_path / "proxy.jsonl"
    _write(source, _lines(tokenizer, lambda x: _set(x, "request", "top_p", value=0)))
    result = convert("vllm", [source], tokenizer, identity, tmp_path / "t")
    assert result["converted"] == 1 and result["rejected"] == {"top_p must be in": 1}
    assert [r["sampling"]["top_p"] for r in read_traffic(tmp_path / "t")] == [1.0]
    assert "top_p must be in (0, 1], got 0.0" in (tmp_path / "t" / "rejects.jsonl").read_text()


def _chat(tokenizer, *, prompt_content="print squares", reply="for i in range(10):") -> dict:
    line = copy.deepcopy(vllm_lines(tokenizer)[1])
    line["request"]["messages"][0]["content"] = prompt_content
    choice = line["response"]["choices"][0]
    choice["message"]["content"] = reply
    choice.pop("logprobs")
    line["response"]["id"] = f"chat-{prompt_content!r}-{reply!r}"
    return line


def test_chat_content_that_is_not_text_and_empty_completions_are_rejected(traffic_target, tmp_path):
    _, tokenizer, identity = traffic_target
    source = tmp_path / "proxy.jsonl"
    parts = [{"type": "text", "text": "print "}, {"type": "text", "text": "squares"}]
    lines = [
        _chat(tokenizer, prompt_content=5, reply=""),
        _chat(tokenizer, prompt_content=5),
        _chat(tokenizer, reply=5),
        _chat(tokenizer, reply=""),
        _chat(tokenizer, prompt_content=parts),  # text parts: converted, joined
    ]
    _write(source, lines)
    result = convert("vllm", [source], tokenizer, identity, tmp_path / "t")
    assert result["converted"] == 1
    assert result["rejected"] == {
        "messages[0] needs a string 'role' and a string": 2,
        "the reply's content must be a string, got int": 1,
        "an empty completion": 1,
    }
    (record,) = read_traffic(tmp_path / "t")
    assert record["prompt"] == [{"role": "user", "content": "print squares"}]


def test_an_out_that_is_a_file_is_one_line_and_kept(traffic_target, tmp_path, capsys):
    path, tokenizer, _ = traffic_target
    source = tmp_path / "proxy.jsonl"
    _write(source, _lines(tokenizer))
    out = tmp_path / "traffic.jsonl"
    out.write_text("keep me\n")
    argv = ["--from", "vllm", "--target", path, "--input", str(source), "--out", str(out)]
    assert run_guarded(main, argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: --out {out} exists and is not a directory (a traffic directory)\n"
    assert out.read_text() == "keep me\n"


@pytest.mark.parametrize("name", ["bytearray", "bytes"])
def test_a_pickle_cannot_call_bytes_to_allocate(traffic_target, tmp_path, name):
    _, tokenizer, identity = traffic_target
    size = 10**8  # 2**31 in the wild: 35 bytes of pickle, 2 GiB allocated
    # protocol 2: builtins.<name>(size) through REDUCE
    dump = b"\x80\x02cbuiltins\n" + name.encode() + b"\n" + pickle.dumps(size, 2)[2:-1] + b"\x85R."
    assert len(dump) < 40
    folder = tmp_path / "dump"
    folder.mkdir()
    (folder / "a_huge.pkl").write_bytes(dump)
    good = [
        (
            GenerateReqInput("def f(x):\n", {"temperature": 1.0, "max_new_tokens": 8}),
            {"text": "return x", "meta_info": {"id": "s1"}},
        )
    ]
    (folder / "b_good.pkl").write_bytes(pickle.dumps(good))
    tracemalloc.start()
    try:
        result = convert("sglang", sorted(folder.iterdir()), tokenizer, identity, tmp_path / "t")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < size // 10
    assert result["converted"] == 1
    assert result["rejected"] == {"a dump entry is not a": 1}
