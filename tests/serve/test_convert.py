"""vLLM responses and SGLang request dumps become traffic records the online job reads."""

import json
import os
import pickle

import pytest

from specdistill.drafts.hub import load_tokenizer
from specdistill.drafts.identity import model_identity
from specdistill.serve.convert import convert
from specdistill.serve.convert_cli import main
from specdistill.serve.traffic import read_traffic

SPEC = {
    "num_spec_steps": 4,
    "num_draft_tokens": 16,
    "num_accepted_draft_tokens": 10,
    "acceptance_histogram": [4, 3, 2, 1],
    "mean_acceptance_length": 3.5,
    "draft_acceptance_rate": 0.625,
}


@pytest.fixture
def target(tiny_pair):
    path = str(tiny_pair[0])
    return path, load_tokenizer(path), {"name": path, "identity": model_identity(path)}


def vllm_lines(tokenizer) -> list[dict]:
    text = "    return a + b\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    completion = {
        "request": {
            "model": "t",
            "prompt": "def add(a, b):\n",
            "temperature": 0.7,
            "max_tokens": 16,
            "metadata": {"category": "code"},
            "logprobs": 2,
        },
        "response": {
            "id": "cmpl-1",
            "created": 1700000000,
            "choices": [
                {
                    "text": text,
                    "finish_reason": "stop",
                    "token_ids": ids,
                    "logprobs": {"top_logprobs": [{t: -0.1} for t in tokens]},
                }
            ],
            "metrics": {"speculative_decoding": SPEC},
        },
    }
    chat = {
        "request": {"model": "t", "messages": [{"role": "user", "content": "print squares"}]},
        "response": {
            "id": "chatcmpl-2",
            "created": 1700000001,
            "choices": [
                {
                    "message": {"role": "assistant", "content": "for i in range(10):"},
                    "finish_reason": "length",
                    "logprobs": {
                        "content": [
                            {
                                "token": t,
                                "logprob": -0.5,
                                "top_logprobs": [{"token": t, "logprob": -0.5}],
                            }
                            for t in tokenizer.convert_ids_to_tokens(
                                tokenizer.encode("for i in range(10):", add_special_tokens=False)
                            )
                        ]
                    },
                }
            ],
        },
    }
    two_choices = {"request": {"prompt": "x"}, "response": {"choices": [{}, {}]}}
    return [completion, chat, two_choices]


def test_vllm_responses_become_records(target, tmp_path):
    path, tokenizer, identity = target
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


class GenerateReqInput:  # stands for SGLang's class: the dump names a class we never import
    def __init__(self, text, sampling_params):
        self.text, self.sampling_params, self.rid = text, sampling_params, "r1"


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/specdistill-convert-pwned",))


def test_sglang_dump_becomes_records_without_running_its_code(target, tmp_path):
    path, tokenizer, identity = target
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


def test_cli_converts_and_reports(target, tmp_path, capsys):
    path, tokenizer, _ = target
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


def test_cli_target_adapter_enters_the_identity(target, tiny_adapter, tmp_path):
    """--target-adapter: the records carry base + adapter's identity, as the server's."""
    path, tokenizer, _ = target
    source = tmp_path / "proxy.jsonl"
    source.write_text(json.dumps(vllm_lines(tokenizer)[0]) + "\n")
    out = tmp_path / "t"
    args = ["--from", "vllm", "--input", str(source), "--target", path, "--out", str(out)]
    assert main([*args, "--target-adapter", str(tiny_adapter)]) == 0
    (record,) = read_traffic(out)
    assert record["target"]["identity"] == model_identity(path, adapter=str(tiny_adapter))
    assert record["target"]["identity"] != model_identity(path)
