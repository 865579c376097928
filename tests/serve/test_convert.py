"""vLLM responses and SGLang request dumps become traffic records the online job reads."""

import json
import os
import pickle

import pytest

from specdistill.formats.traffic_shards import read_traffic
from specdistill.models.identity import model_identity
from specdistill.serve.convert import convert
from specdistill.serve.convert_cli import main
from tests.serve.helpers import GenerateReqInput, vllm_lines


def test_vllm_responses_become_records(traffic_target, tmp_path):
    path, tokenizer, identity = traffic_target
    source = tmp_path / "proxy.jsonl"
    source.write_text("\n".join(map(json.dumps, vllm_lines(tokenizer))) + "\n{not json\n")
    result = convert("vllm", [source], tokenizer, identity, tmp_path / "traffic")
    assert result["converted"] == 2
    assert sum(result["rejected"].values()) == 2  # n=2 and the bad line, each with a reason
    records = read_traffic(tmp_path / "traffic")
    first, chat = records
    assert first["target"]["identity"] == model_identity(path)
    assert first["speculative"]["num_accepted_draft_tokens"] == 10
    assert first["speculative"]["mean_acceptance_length"] == pytest.approx(1 + 10 / 4)
    assert first["category"] == "code" and first["sampling"]["temperature"] == 0.7
    assert tokenizer.decode(first["completion_token_ids"]) == "    return a + b\n"
    assert [pair[0] for pair in first["top_logprobs"][0]] == first["completion_token_ids"][:1]
    assert chat["endpoint"] == "chat.completions" and chat["finish_reason"] == "length"
    assert chat["prompt_token_ids"] == tokenizer.apply_chat_template(
        chat["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert chat["speculative"]["num_spec_steps"] == 0  # no statistics in that response
    rejects = (tmp_path / "traffic" / "rejects.jsonl").read_text().splitlines()
    assert any("expected one choice" in r for r in rejects)


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/specdistill-convert-pwned",))


def test_sglang_dump_becomes_records_without_running_its_code(traffic_target, tmp_path):
    path, tokenizer, identity = traffic_target
    out_ids = tokenizer.encode("return x", add_special_tokens=False)
    meta = {
        "id": "s1",
        "finish_reason": {"type": "length"},
        "spec_verify_ct": 2,
        "spec_accept_token_num": 3,
        "spec_draft_token_num": 6,
        "spec_accept_histogram": [2, 1, 0],
    }
    entries = [
        (
            GenerateReqInput("def f(x):\n", {"temperature": 1.0, "max_new_tokens": 8}),
            {"text": "return x", "output_ids": out_ids, "meta_info": meta},
            0.0,
            1.0,
        ),
        (Exploit(), {"text": "x", "meta_info": {}}),
    ]
    dump = tmp_path / "dump" / "sglang_request_dump_1.pkl"
    dump.parent.mkdir()
    dump.write_bytes(pickle.dumps(entries))
    if os.path.exists("/tmp/specdistill-convert-pwned"):
        os.remove("/tmp/specdistill-convert-pwned")
    result = convert("sglang", [dump], tokenizer, identity, tmp_path / "traffic")
    assert not os.path.exists("/tmp/specdistill-convert-pwned")
    assert result["converted"] == 1 and sum(result["rejected"].values()) == 1
    (record,) = read_traffic(tmp_path / "traffic")
    assert record["completion_token_ids"] == out_ids
    assert record["finish_reason"] == "length" and record["sampling"]["max_tokens"] == 8
    assert record["speculative"]["draft_acceptance_rate"] == pytest.approx(0.5)
    assert record["speculative"]["mean_acceptance_length"] == pytest.approx(2.5)


def test_cli_converts_and_reports(traffic_target, tmp_path, capsys):
    path, tokenizer, _ = traffic_target
    source = tmp_path / "proxy.jsonl"
    source.write_text(json.dumps(vllm_lines(tokenizer)[0]) + "\n")
    assert (
        main(
            [
                "--from",
                "vllm",
                "--input",
                str(source),
                "--target",
                path,
                "--out",
                str(tmp_path / "t"),
            ]
        )
        == 0
    )
    assert "converted 1 records" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="no such file"):
        main(
            [
                "--from",
                "vllm",
                "--input",
                str(tmp_path / "missing"),
                "--target",
                path,
                "--out",
                str(tmp_path / "t"),
            ]
        )


def test_cli_target_adapter_enters_the_identity(traffic_target, tiny_adapter, tmp_path):
    """--target-adapter: the records carry base + adapter's identity, as the server's."""
    path, tokenizer, _ = traffic_target
    source = tmp_path / "proxy.jsonl"
    source.write_text(json.dumps(vllm_lines(tokenizer)[0]) + "\n")
    out = tmp_path / "t"
    args = ["--from", "vllm", "--input", str(source), "--target", path, "--out", str(out)]
    assert main([*args, "--target-adapter", str(tiny_adapter)]) == 0
    (record,) = read_traffic(out)
    assert record["target"]["identity"] == model_identity(path, adapter=str(tiny_adapter))
    assert record["target"]["identity"] != model_identity(path)


def test_a_token_id_prompt_is_converted_with_its_ids(traffic_target, tmp_path):
    _, tokenizer, identity = traffic_target
    line = vllm_lines(tokenizer)[0]
    ids = tokenizer.encode("def add(a, b):\n", add_special_tokens=False)
    line["request"]["prompt"] = ids
    other = json.loads(json.dumps(line))
    other["response"]["id"] = "cmpl-other"
    other["response"]["choices"][0]["prompt_token_ids"] = ids[:-1]  # not the prompt's
    bad = json.loads(json.dumps(line))
    bad["response"]["id"] = "cmpl-bad"
    bad["request"]["prompt"] = [1, -2]
    source = tmp_path / "proxy.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in (line, other, bad)))
    result = convert("vllm", [source], tokenizer, identity, tmp_path / "traffic")
    (record,) = read_traffic(tmp_path / "traffic")
    assert record["prompt_token_ids"] == ids and record["prompt"] == ids
    assert result["converted"] == 1 and sum(result["rejected"].values()) == 2
    rejects = (tmp_path / "traffic" / "rejects.jsonl").read_text()
    assert "differ from the prompt's ids" in rejects and "string or token ids" in rejects


def test_logprob_tokens_given_as_token_ids_are_taken_as_ids(traffic_target, tmp_path):
    """vLLM's --return-tokens-as-token-ids: "token_id:N" keys, exact where decoded strings
    are empty or collide."""
    _, tokenizer, identity = traffic_target
    line = vllm_lines(tokenizer)[0]
    ids = line["response"]["choices"][0]["token_ids"]
    line["response"]["choices"][0]["logprobs"] = {
        "top_logprobs": [{f"token_id:{i}": -0.1, f"token_id:{(i + 1) % 50}": -2.5} for i in ids]
    }
    outside = json.loads(json.dumps(line))
    outside["response"]["id"] = "cmpl-outside"
    outside["response"]["choices"][0]["logprobs"]["top_logprobs"][0] = {"token_id:999999": -1.0}
    source = tmp_path / "proxy.jsonl"
    source.write_text(json.dumps(line) + "\n" + json.dumps(outside) + "\n")
    result = convert("vllm", [source], tokenizer, identity, tmp_path / "traffic")
    (record,) = read_traffic(tmp_path / "traffic")
    assert [[p[0] for p in top] for top in record["top_logprobs"]] == [
        [i, (i + 1) % 50] for i in ids
    ]
    assert (
        result["converted"] == 1
        and "outside the target's vocabulary"
        in (tmp_path / "traffic" / "rejects.jsonl").read_text()
    )
