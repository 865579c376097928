"""The online loop behind a live vLLM (online_demo/vllm_loop.py): vLLM's OpenAI server behind
the logging proxy, a new draft deployed on a second server while clients keep sending, and a
short `specdistill online demo --engine vllm` round end to end (traffic converted, refreshed,
served acceptance scraped from vLLM's /metrics).

vLLM is an optional dependency (tests/vllm_support.py): skipped without it.
"""

import json
import sys
import threading
import urllib.request

import pytest
from transformers import AutoTokenizer, LlamaForCausalLM

from specdistill.drafts.draft_init import draft_from_target
from specdistill.eval.vllm_engine import VllmSettings
from specdistill.models.identity import model_identity
from specdistill.online_demo.vllm_loop import Deployment, Scraper
from specdistill.serve.convert import convert
from specdistill.serve.vllm_server import VllmServerSettings
from tests.helpers import save_sharp_target
from tests.processes import run_bounded, why_failed
from tests.vllm_support import VLLM_ENV, needs_vllm

pytestmark = needs_vllm


def request(url: str, prompt: list[int]) -> tuple[int, dict]:
    body = {"model": "t", "prompt": prompt, "max_tokens": 12, "temperature": 0.0}
    body |= {"logprobs": 5, "return_token_ids": True}
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode()[:300]}
    except OSError as e:
        return 0, {"error": repr(e)}


def test_a_new_draft_is_deployed_while_clients_send_and_none_fails(tiny_pair, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    target = save_sharp_target(tokenizer, tmp_path / "target", hidden=64, layers=4, positions=512)
    model = LlamaForCausalLM.from_pretrained(target).eval()
    drafts = {}
    for version, layers in (("v000001", 1), ("v000002", 2)):
        drafts[version] = tmp_path / version
        draft_from_target(model, layers).save_pretrained(drafts[version])
        tokenizer.save_pretrained(drafts[version])
    settings = VllmServerSettings(
        target=str(target),
        name="t",
        engine=VllmSettings(kv_cache_gib=1.0, max_num_seqs=4, threads=1),
        gamma=2,
        max_logprobs=5,
        max_model_len=512,
    )
    deployment = Deployment(
        settings, lambda v: (str(drafts[v]), {"method": "draft_model"}), tmp_path, drain_s=120
    )
    url = deployment.start("v000001")
    scraper = Scraper(tmp_path / "served.jsonl")
    first = deployment.upstream
    results, stop = [], threading.Event()

    def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            results.append(request(url, [1 + (i * 7 + n) % 50, 60, 61, 62]))
            n += 1

    clients = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    try:
        scraper.read(first)
        for c in clients:
            c.start()
        event = deployment.deploy("v000002", scraper.read)
        stop.set()
        for c in clients:
            c.join(timeout=300)
        scraper.read(deployment.upstream)
    finally:
        stop.set()
        deployment.stop()
    failures = [r for r in results if r[0] != 200]
    assert not failures, failures[:3]
    assert event["drained"] and deployment.version == "v000002" and deployment.upstream != first
    assert len(results) >= 4
    served_by = {w["url"] for w in scraper.windows if w["drafts"] > 0}
    assert first in served_by  # the old server answered with its draft before the switch
    log = tmp_path / "proxy-log.jsonl"
    assert len(log.read_text().splitlines()) == len(results)
    identity = {"name": str(target), "identity": model_identity(str(target))}
    converted = convert("vllm", [log], tokenizer, identity, tmp_path / "traffic")
    assert converted["converted"] == len(results) and not converted["rejected"]


def test_a_short_online_round_behind_vllm(tmp_path):
    out = tmp_path / "demo"
    argv = ["online", "demo", "--engine", "vllm", "--out", str(out), "--shift", "traffic"]
    argv += ["--fit-steps", "0", "--phase-seconds", "20,40,20", "--refresh-records", "8"]
    argv += ["--holdout", "8", "--scrape-s", "5", "--eval-sequences", "8", "--clients", "2"]
    argv += ["--bootstrap", "100", "--threads", "1"]
    proc = run_bounded([sys.executable, "-m", "specdistill", *argv], env=VLLM_ENV, timeout=900)
    assert proc.returncode == 0, why_failed(proc)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed_requests"] == 0
    assert summary["records_logged"] == summary["requests_served"] > 0
    assert summary["refreshes"] >= 1 and not summary["job_errors"]
    vllm = summary["vllm"]
    assert vllm["scrape_windows"] >= 3 and vllm["proxy"]["logged"] == summary["requests_served"]
    assert vllm["from_metrics"]["before_shift"]["rounds"] > 0
    assert (out / "served_alpha_vllm.png").stat().st_size > 0
    for event in vllm["deployments"]:  # every server it started has stopped
        with pytest.raises(OSError):
            urllib.request.urlopen(event["url"] + "/health", timeout=5)
