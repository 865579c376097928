"""`specdistill serve` over HTTP with the official openai client, on the tiny pair."""

import json
import shutil
import threading
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdistill.formats.traffic import TrafficError
from specdistill.formats.traffic_shards import read_traffic
from specdistill.serve.traffic import TrafficLog
from tests.helpers import hf_greedy

PROMPTS = ["def add(a, b):", "class Point:\n    def", "for i in range(10):"]
SPEC_KEYS = {
    "mean_acceptance_length",
    "draft_acceptance_rate",
    "acceptance_histogram",
    "num_spec_steps",
    "num_draft_tokens",
    "num_accepted_draft_tokens",
    "drafted_length_histogram",
    "mean_drafted_length",
    "mean_predicted_acceptance",
    "mean_realised_acceptance",
}


@pytest.fixture(scope="module")
def hf(tiny_pair):
    target, _, _ = tiny_pair
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    return model, AutoTokenizer.from_pretrained(target)


def records_by_id(server) -> dict:
    return {r["id"]: r for r in read_traffic(server[1].traffic.dir)}


def test_completion_stats_and_greedy_equals_hf(client, server, hf):
    """Greedy over HTTP is the target's own greedy decode (HF generate), streamed or not,
    with concurrent requests sharing the batch; each response carries vLLM-shaped stats."""
    _, tok = hf
    results = {}

    def one(i, prompt, stream):
        if stream:
            chunks = list(
                client.completions.create(
                    model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True
                )
            )
            results[i] = ("".join(c.choices[0].text for c in chunks), chunks[-1])
        else:
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
            results[i] = (r.choices[0].text, r)

    jobs = [(i, p, s) for i, (p, s) in enumerate((p, s) for p in PROMPTS for s in (False, True))]
    threads = [threading.Thread(target=one, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = records_by_id(server)
    for i, prompt, _ in jobs:
        text, last = results[i]
        ids = tok(prompt)["input_ids"]
        expected = hf_greedy(*hf, ids, 24)
        assert text == tok.decode(expected, skip_special_tokens=True)
        assert records[last.id]["completion_token_ids"] == expected
        assert records[last.id]["prompt_token_ids"] == ids
        spec = last.metrics["speculative_decoding"]
        assert set(spec) == SPEC_KEYS
        assert spec["num_draft_tokens"] == 3 * spec["num_spec_steps"] > 0
        assert sum(spec["acceptance_histogram"]) == spec["num_accepted_draft_tokens"]
        assert len(spec["acceptance_histogram"]) == 3
        assert spec["mean_acceptance_length"] == pytest.approx(
            1 + spec["num_accepted_draft_tokens"] / spec["num_spec_steps"]
        )
        assert last.draft_version == str(server[1].worker.version)


def test_usage_n_and_models(client):
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, n=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, logprobs=21)
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_stream_equals_non_stream(client, hf):
    messages = [{"role": "system", "content": "code"}, {"role": "user", "content": "add"}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=16, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == r.choices[0].message.content
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    model, tok = hf
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert r.usage.prompt_tokens == len(ids)
    expected = tok.decode(hf_greedy(*hf, ids, 16), skip_special_tokens=True)
    assert r.choices[0].message.content == expected


def test_logprobs_are_the_targets(client, hf):
    model, tok = hf
    r = client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and all(len(t) <= 3 for t in lp.top_logprobs)
    ids = tok(PROMPTS[1])["input_ids"]
    out = hf_greedy(*hf, ids, 6)
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1]
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(out)[:, None])[:, 0]
    assert lp.token_logprobs == pytest.approx(expected.tolist(), abs=1e-4)
    # greedy: the chosen token is the most probable one
    assert all(
        v == pytest.approx(max(top.values()))
        for v, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True)
    )
    c = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 for e in content)


def test_stop_strings_and_seed(client):
    full = (
        client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=24, temperature=0)
        .choices[0]
        .text
    )
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = client.completions.create(
        model="tiny", prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    streamed = client.completions.create(
        model="tiny", prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == cut.text

    def sampled(seed):
        return (
            client.completions.create(
                model="tiny",
                prompt=PROMPTS[0],
                max_tokens=16,
                temperature=1.0,
                top_p=0.9,
                seed=seed,
            )
            .choices[0]
            .text
        )

    a = sampled(5)
    noise = [threading.Thread(target=sampled, args=(s,)) for s in (1, 2)]
    for t in noise:
        t.start()
    b = sampled(5)  # shares the batch with the noise requests
    for t in noise:
        t.join()
    assert a == b


def test_metrics(client, server):
    client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    text = httpx.get(server[0] + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    value = {
        f.name: sum(s.value for s in f.samples if s.name.endswith("_total"))
        for f in families.values()
        if f.type == "counter"
    }
    assert value["specdistill:spec_decode_num_drafts"] > 0
    assert (
        value["specdistill:spec_decode_num_draft_tokens"]
        == 3 * value["specdistill:spec_decode_num_drafts"]
    )
    per_pos = families["specdistill:spec_decode_num_accepted_tokens_per_pos"].samples
    assert {s.labels["position"] for s in per_pos} <= {"0", "1", "2"}
    assert sum(s.value for s in per_pos) == value["specdistill:spec_decode_num_accepted_tokens"]
    assert value["specdistill:generation_tokens"] >= 8
    for name in (
        "specdistill:e2e_request_latency_seconds",
        "specdistill:time_to_first_token_seconds",
    ):
        assert families[name].type == "histogram"
        count = [s for s in families[name].samples if s.name.endswith("_count")][0]
        assert count.value >= 1
    (info,) = families["specdistill:draft_version_info"].samples
    assert info.labels["version"] == server[1].worker.version


def test_disconnect_frees_the_row(server):
    url, srv = server
    with httpx.Client(timeout=30) as http:
        with http.stream(
            "POST",
            url + "/v1/completions",
            json={
                "prompt": PROMPTS[0],
                "max_tokens": 2000,
                "temperature": 0,
                "stream": True,
            },
        ) as response:
            assert response.status_code == 200
            next(response.iter_lines())
    deadline = time.monotonic() + 10
    while srv.worker.current.busy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not srv.worker.current.busy


def test_traffic_records_round_trip(client, server):
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=5,
        temperature=0.7,
        seed=1,
        extra_body={"metadata": {"category": "greeting"}},
    )
    rec = records_by_id(server)[r.id]
    assert rec["category"] == "greeting" and rec["prompt"] == [{"role": "user", "content": "hello"}]
    assert rec["sampling"]["temperature"] == 0.7 and rec["sampling"]["seed"] == 1
    assert len(rec["top_logprobs"]) == len(rec["completion_token_ids"]) == 5
    assert all(len(t) == 3 for t in rec["top_logprobs"])
    assert rec["completion_text"] == r.choices[0].message.content
    assert rec["target"]["identity"].startswith("sha256:")
    assert rec["speculative"] == r.metrics["speculative_decoding"]


def test_traffic_log_rotates_and_skips_torn_lines(tmp_path, server):
    good = next(iter(records_by_id(server).values()))
    log = TrafficLog(tmp_path, max_bytes=3 * len(json.dumps(good)))
    for i in range(7):
        log.append({**good, "id": f"r{i}"})
    log.close()
    shards = sorted(tmp_path.glob("traffic-*.jsonl"))
    assert len(shards) >= 3
    with open(shards[-1], "a") as f:
        f.write(json.dumps({**good, "id": "torn"})[:40])  # a crash mid-write
    assert [r["id"] for r in read_traffic(tmp_path)] == [f"r{i}" for i in range(7)]
    TrafficLog(tmp_path).append({**good, "id": "r7"})  # a restart opens a new shard
    assert [r["id"] for r in read_traffic(tmp_path)][-1] == "r7"
    with pytest.raises(TrafficError):
        TrafficLog(tmp_path).append({**good, "completion_token_ids": "x"})
    with open(shards[0], "a") as f:
        f.write('{"schema_version": 1}\n')
    with pytest.raises(TrafficError, match="traffic-000001"):
        read_traffic(tmp_path)


def test_hot_swap_under_load(tiny_pair, published, tmp_path):
    """Versions switch while concurrent clients stream requests: no failures, both versions
    named, a broken version skipped with the old one still serving."""
    from specdistill.publish import atomic_write_text
    from specdistill.serve.options import ServeOptions
    from specdistill.serve.server import Server

    root = tmp_path / "published"
    shutil.copytree(published, root)
    srv = Server(
        ServeOptions(
            target=str(tiny_pair[0]),
            drafts=str(root),
            gamma=2,
            max_num_seqs=4,
            traffic=str(tmp_path / "traffic"),
            poll_s=0.1,
            served_model_name="m",
        )
    )
    url = srv.start()
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    seen, failures, stop = [], [], threading.Event()

    def load(i):
        while not stop.is_set():
            try:
                started = time.monotonic()
                r = client.completions.create(
                    model="m",
                    prompt=PROMPTS[i % 3],
                    max_tokens=12,
                    temperature=0.8 * (i % 2),
                    seed=i,
                )
                seen.append((started, r.draft_version, r.id))
            except Exception as e:  # noqa: BLE001
                failures.append(e)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.8)
        atomic_write_text(root / "current", "v000003\n")  # broken: skipped
        deadline = time.monotonic() + 10
        while "v000003" not in srv.watcher.failed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "v000003" in srv.watcher.failed
        assert srv.worker.version == "v000001"
        atomic_write_text(root / "current", "v000002\n")
        while srv.worker.version != "v000002" and time.monotonic() < deadline:
            time.sleep(0.05)
        swapped = time.monotonic()
        while time.monotonic() < deadline and sum(t > swapped for t, _, _ in seen) < 4:
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join()
        srv.stop()
    assert not failures
    versions = [v for _, v, _ in seen]
    assert "v000001" in versions and "v000002" in versions
    # a request is decoded by the version serving when it arrived, from start to end
    assert all(v == "v000002" for t, v, _ in seen if t > swapped)
    records = {r["id"]: r for r in read_traffic(tmp_path / "traffic")}
    assert len(records) == len(seen)
    assert all(records[i]["draft_version"] == v for _, v, i in seen)
