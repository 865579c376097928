"""`specdistill regenerate` (train/regenerate.py): a run killed midway and rerun answers every
distinct prompt exactly once; failures are retried and recorded; the output trains."""

import json

import pytest

from specdistill.data import build_datasets
from specdistill.eval import engine
from specdistill.models.hub import load_tokenizer
from specdistill.train import regenerate_answering as answering_module
from specdistill.train.config import load_recipe
from specdistill.train.regenerate import RegenerateError, Sampling, regenerate
from specdistill.train.regenerate_output import FAILURES, answered
from tests.train.helpers import overrides


class Killed(BaseException):  # as a SIGKILL: not caught by the per-prompt retry
    pass


def _chat_data(tmp_path, n=9):
    path = tmp_path / "chat.jsonl"
    rows = []
    for i in range(n):
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"write code {i}"},
                    {"role": "assistant", "content": "old answer"},
                ]
            }
        )
    rows.append(rows[0])  # a duplicate prompt
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _records(out):
    lines = []
    for p in sorted(out.glob("regen-*.jsonl")):
        lines += [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    return lines


def test_resume_after_a_kill_answers_each_prompt_once(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setattr(answering_module, "CHUNK_BATCHES", 1)  # a chunk is one batch here
    data = _chat_data(tmp_path)
    recipe = load_recipe(None, overrides(tiny_pair, tmp_path / "u", **{"data.train": str(data)}))
    out = tmp_path / "regen"
    sampling = Sampling(temperature=1.0, max_new_tokens=6, seed=0)
    calls = []

    def dies_on_third_batch(*args, **kwargs):
        calls.append(len(args[2]))
        if len(calls) == 3:
            raise Killed
        return engine.generate(*args, **kwargs)

    with pytest.raises(Killed):
        regenerate(
            recipe,
            out,
            sampling=sampling,
            batch_size=2,
            shard_records=3,
            generate=dies_on_third_batch,
            print=lambda *a: None,
        )
    first = _records(out)
    assert len(first) == 4  # two batches of two written before the kill
    # a torn final line, as a kill during a write leaves it
    shard = sorted(out.glob("regen-*.jsonl"))[-1]
    with open(shard, "a") as f:
        f.write('{"messages": [{"role": "user", "conte')
    manifest = regenerate(
        recipe, out, sampling=sampling, batch_size=2, shard_records=3, print=lambda *a: None
    )
    records = [r for r in _records_skipping_torn(out)]
    hashes = [r["prompt_hash"] for r in records]
    assert len(hashes) == len(set(hashes)) == 9  # 10 rows, one duplicate
    assert manifest["complete"] and manifest["answered"] == 9
    assert manifest["duplicates_dropped"] == 1
    assert manifest["target"]["identity"].startswith("sha256:")
    assert manifest["sampling"]["temperature"] == 1.0
    assert answered(out) == set(hashes)
    assert all(p.read_bytes().endswith(b"\n") for p in out.glob("regen-*.jsonl"))  # cut off
    for r in records:
        assert r["messages"][0]["role"] == "user" and r["messages"][-1]["role"] == "assistant"
        assert r["messages"][-1]["content"] != "old answer" or r["completion_tokens"] > 0
    # a third run has nothing to do
    again = regenerate(recipe, out, sampling=sampling, batch_size=2, print=lambda *a: None)
    assert again["answered"] == 9 and len(list(_records_skipping_torn(out))) == 9
    # the output is training data
    tokenizer = load_tokenizer(str(tiny_pair[0]))
    train, _ = build_datasets(tokenizer, [str(out / "regen-*.jsonl")], [str(data)], max_length=32)
    assert len(train) > 0
    # other sampling parameters are refused
    with pytest.raises(RegenerateError, match="sampling"):
        regenerate(recipe, out, sampling=Sampling(temperature=0.5), print=lambda *a: None)


def _records_skipping_torn(out):
    for p in sorted(out.glob("regen-*.jsonl")):
        for line in p.read_bytes().split(b"\n")[:-1]:
            if line.strip():
                yield json.loads(line)


def test_failures_are_retried_and_recorded(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setattr(answering_module, "CHUNK_BATCHES", 1)  # a chunk is one batch here
    data = _chat_data(tmp_path, n=4)
    recipe = load_recipe(None, overrides(tiny_pair, tmp_path / "u", **{"data.train": str(data)}))
    out = tmp_path / "regen"
    tokenizer = load_tokenizer(str(tiny_pair[0]))
    bad = tokenizer.apply_chat_template(
        [{"role": "user", "content": "write code 2"}], tokenize=False, add_generation_prompt=True
    )
    bad_ids = tokenizer(bad, add_special_tokens=False)["input_ids"]
    attempts = []

    def fails_on_prompt_2(target, draft, prompts, **kwargs):
        if any(p == bad_ids for p in prompts):
            attempts.append(len(prompts))
            raise RuntimeError("CUDA out of memory (simulated)")
        return engine.generate(target, draft, prompts, **kwargs)

    manifest = regenerate(
        recipe,
        out,
        sampling=Sampling(max_new_tokens=4),
        batch_size=2,
        retries=2,
        generate=fails_on_prompt_2,
        print=lambda *a: None,
    )
    assert attempts == [2, 1, 1, 1]  # the batch, then 1 + 2 retries alone
    failures = [json.loads(x) for x in (out / FAILURES).read_text().splitlines()]
    assert len(failures) == 1 and "out of memory" in failures[0]["error"]
    assert failures[0]["attempts"] == 3
    assert manifest["answered"] == 3 and not manifest["complete"]
    # a rerun retries the failed prompt (now working) and completes
    manifest = regenerate(
        recipe, out, sampling=Sampling(max_new_tokens=4), batch_size=2, print=lambda *a: None
    )
    assert manifest["complete"] and manifest["answered"] == 4


def test_the_engine_gets_several_batches_at_once_and_refills_its_rows(tiny_pair, tmp_path):
    """Prompts go to the engine CHUNK_BATCHES batches at a time with the batch size as its
    row count, so a row whose answer ended takes the next prompt of the chunk."""
    data = _chat_data(tmp_path)
    recipe = load_recipe(None, overrides(tiny_pair, tmp_path / "u", **{"data.train": str(data)}))
    calls = []

    def recorded(*args, **kwargs):
        calls.append((len(args[2]), kwargs["batch_size"]))
        return engine.generate(*args, **kwargs)

    manifest = regenerate(
        recipe,
        tmp_path / "regen",
        sampling=Sampling(max_new_tokens=4),
        batch_size=2,
        generate=recorded,
        print=lambda *a: None,
    )
    chunk = 2 * answering_module.CHUNK_BATCHES
    n = manifest["prompts"]
    assert n > chunk and manifest["complete"]
    assert calls == [(min(chunk, n - i), 2) for i in range(0, n, chunk)]
