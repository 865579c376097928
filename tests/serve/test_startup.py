"""The server's start-up: the first request is warmed before anything answers (/health
included); the thread count and the machine's load are said."""

import threading

import httpx

from specdistill.drafts import progress
from specdistill.drafts.progress import Load
from specdistill.eval import engine as engine_module
from specdistill.serve import server as server_module


def test_one_generation_runs_before_the_server_answers(tiny_pair, tmp_path, monkeypatch):
    from specdistill.serve.server import Server

    steps = []
    original = engine_module.Engine.step

    def step(self):
        steps.append(threading.current_thread().name)
        return original(self)

    monkeypatch.setattr(engine_module.Engine, "step", step)
    target, draft, _ = tiny_pair
    srv = Server(str(target), str(draft), gamma=2, traffic=str(tmp_path / "traffic"))
    try:
        # The warm-up decoded in the constructor, before the engine thread or HTTP existed.
        assert steps and set(steps) == {threading.main_thread().name}
        assert srv.warm_up_s > 0 and not srv.worker.is_alive()
        warm = len(steps)
        url = srv.start()
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        body = {"model": str(target), "prompt": "def", "max_tokens": 3, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        assert len(steps) > warm and steps[-1] == "specdistill-engine"
    finally:
        srv.stop()
    # The warm-up is no request: the traffic log holds the one real request only.
    records = [line for f in (tmp_path / "traffic").glob("*.jsonl") for line in f.open()]
    assert len(records) == 1


def test_serve_sets_threads_as_asked_and_says_the_load(monkeypatch, caplog):
    import logging

    import torch

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(progress, "machine_load", lambda: Load(3.4, 2))
    with caplog.at_level(logging.INFO, logger="specdistill.serve"):
        server_module.set_threads(3, "cpu")  # --threads
        server_module.set_threads(None, "cpu")  # torch's default, said with the load
        server_module.set_threads(None, "cuda")
    assert calls == [3]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].endswith("load average 3.4 on 2 cores (busy)")
