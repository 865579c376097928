"""Prompt files and the speculative-decoding CLI / report (tiny models, tiny tokenizer)."""

import gzip
import json
import sys
import types
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specdistill.eval import speculative as spec
from specdistill.eval.prompts import encode_prompts, load_prompts, prompt_text
from specdistill.eval.report import SpeculateReport
from tests.eval.helpers import perturbed, tiny_llama

WORDS = ["<pad>", "<eos>", "<unk>", "user", "assistant", ":", *"abcdefghijklmnopqrstuvwxyz"]
PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"  # shipped prompt sets


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {w: i for i, w in enumerate(WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def test_prompt_formats(tmp_path, tokenizer):
    (tmp_path / "p.txt").write_text("a b c\n\nd e\n")
    assert [p.text for p in load_prompts(tmp_path / "p.txt")] == ["a b c", "d e"]
    records = [
        {"id": "x", "prompt": "a b"},
        {"text": "c d"},
        {"question_id": 81, "turns": ["e f", "second turn"]},
        {"messages": [{"role": "user", "content": "g"}]},
    ]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    with gzip.open(tmp_path / "p.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in records))
    for name in ("p.jsonl", "p.jsonl.gz"):
        prompts = load_prompts(tmp_path / name)
        assert [p.id for p in prompts] == ["x", "1", "81", "3"]
        assert prompts[2].messages == [{"role": "user", "content": "e f"}]
    assert len(load_prompts(tmp_path / "p.jsonl", limit=2)) == 2
    # No chat template: "role: content" lines, then the assistant's turn.
    assert prompt_text(prompts[2], tokenizer) == "user: e f\nassistant:"
    ids = encode_prompts(prompts, tokenizer, max_tokens=3)
    assert ids[0] == [6, 7] and ids[2] == [11, 4, 5]  # "a b"; last 3 of "user : e f assistant :"
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "?"}))
    with pytest.raises(ValueError, match="messages / turns / prompt / text"):
        load_prompts(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="unknown prompt file type"):
        load_prompts(tmp_path / "p.csv")


def test_shipped_prompt_sets():
    bench = load_prompts(PROMPTS / "spec_bench_questions.jsonl")
    assert len(bench) == 480 and bench[0].messages[0]["role"] == "user"
    humaneval = load_prompts(PROMPTS / "HumanEval.jsonl.gz")
    assert len(humaneval) == 164 and humaneval[0].id == "HumanEval/0"
    assert humaneval[0].text.startswith("from typing import List")


def test_cli_writes_report(tmp_path, tokenizer, monkeypatch, capsys):
    vocab = len(WORDS)
    target = tiny_llama(0, vocab=vocab, hidden=32, layers=2, init=0.2)
    draft = perturbed(target, 0.02, seed=1)
    fake = types.ModuleType("specdistill.models.hub")
    fake.load_tokenizer = lambda name, revision=None: tokenizer
    fake.load_model = lambda name, dtype: {"tiny:target": target, "tiny:draft": draft}[name]
    fake.load_target = lambda name, adapter=None, dtype="float32", revision=None: fake.load_model(
        name, dtype
    )
    fake.check_tokenizers = lambda *args: None
    fake_loader = types.ModuleType("specdistill.drafts.loader")
    fake_loader.load_draft = fake.load_model
    monkeypatch.setitem(sys.modules, "specdistill.models.hub", fake)
    monkeypatch.setitem(sys.modules, "specdistill.drafts.loader", fake_loader)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": p}) for p in ["a b c", "d e f g h", "i", "j k"])
    )
    out = tmp_path / "out"
    # fmt: off
    result = spec.main([
        "--target", "tiny:target", "--draft", "tiny:draft", "--prompts", str(prompts),
        "--gamma", "1,3", "--adaptive", "--temperature", "0,1", "--batch-size", "3",
        "--max-new-tokens", "12", "--out", str(out),
    ])
    # fmt: on
    for name in [
        "report.json",
        "report.md",
        "outputs.jsonl",
        "acceptance_per_position.png",
        "tau_speedup_vs_gamma.png",
        "rejection_positions.png",
        "latency_cdf.png",
    ]:
        assert (out / name).stat().st_size > 0, name
    assert "NaN" not in (out / "report.json").read_text()  # strict JSON: no data is null
    report = json.loads((out / "report.json").read_text())
    assert [c["tau"] for c in report["configs"]] == [c["tau"] for c in result["configs"]]
    typed = SpeculateReport.read(out / "report.json")  # report.json's schema reads it back
    assert typed.to_json() == (out / "report.json").read_text()
    assert typed.meta is not None and typed.meta.n_prompts == 4
    assert [c["name"] for c in report["configs"]] == [
        "T=0 gamma=1",
        "T=0 gamma=3",
        "T=0 adaptive",
        "T=1 gamma=1",
        "T=1 gamma=3",
        "T=1 adaptive",
    ]
    for c in report["configs"]:
        assert 1.0 <= c["tau"] and c["tau_pred"] >= 1.0 and 0.0 <= c["alpha_offline"] <= 1.0
        assert 0.0 < c["draft_time_share"] < 1.0 and c["tokens_per_s"] > 0 and c["speedup"] > 0
        assert set(c["ttft_s"]) == {"p50", "p95", "p99", "mean"}
        assert len(c["rejection_histogram"]) == len(c["slot_acceptance"])
        lo, hi = c["tau_interval"]  # over the 4 prompts
        assert 1.0 <= lo <= c["tau"] <= hi
    greedy = {c["gamma"]: c for c in report["configs"] if c["temperature"] == 0}
    # At T=0 the pathwise prediction reproduces the measured τ exactly.
    for c in greedy.values():
        assert c["tau_pred_pathwise"] == pytest.approx(c["tau"], abs=1e-9)
    assert set(report["best_gamma"]) == {"0", "1"}
    assert report["best_gamma"]["0"]["measured"] in (1, 3)
    lines = [json.loads(x) for x in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 4 * (6 + 2)  # prompts × (configs + target-only baselines)
    by_config = {}
    for line in lines:
        assert set(line) == {"id", "config", "prompt", "output_ids", "text"}
        by_config.setdefault(line["config"], []).append(line["output_ids"])
    # Greedy speculative output is the target's own greedy output.
    for name in ("T=0 gamma=1", "T=0 gamma=3", "T=0 adaptive"):
        assert by_config[name] == by_config["T=0 target-only"]
    assert all(len(ids) == 12 for ids in by_config["T=1 gamma=3"])
    assert "Measured vs predicted τ" in (out / "report.md").read_text()
    # The losslessness check: every greedy configuration reproduced all 4 target outputs.
    assert [c["greedy_identical"] for c in report["configs"]] == [4, 4, 4, None, None, None]
    checks = [c.get("greedy_check") for c in report["configs"]]
    assert checks[3:] == [None] * 3
    for check in checks[:3]:
        assert check["exact_match_rate"] == 1.0 and check["divergences"] == []
        assert (check["near_ties"], check["real_errors"], check["run_dtype"]) == (0, 0, "float32")
    assert "## Greedy losslessness (T=0)" in (out / "report.md").read_text()
    printed = capsys.readouterr()
    # A line per decoding run as it ends (2 temperatures x (target alone + 3 configurations)),
    # then one screen, not the wide table (that stays in report.md).
    runs = [line for line in printed.err.splitlines() if line.startswith("[speculate] T=")]
    assert len(runs) == 8 and "T=0 target alone:" in runs[0] and "ETA" in runs[0]
    assert "Lossless: at T=0 every output equals the target alone's" in printed.out
    assert "best γ = " in printed.out and str(out / "report.md") in printed.out
    assert "| config |" not in printed.out and "| config |" in (out / "report.md").read_text()
    assert len(printed.out.splitlines()) <= 24
