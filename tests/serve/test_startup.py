"""The server's start-up: the first request is warmed before anything answers (/health
included); the thread count and the machine's load are said."""

import threading

import httpx

from specdistill.eval import engine as engine_module
from specdistill.serve import serve_cli


def test_one_generation_runs_before_the_server_answers(tiny_pair, tmp_path, monkeypatch):
    from specdistill.serve.options import ServeOptions
    from specdistill.serve.server import Server

    steps = []
    original = engine_module.Engine.step

    def step(self):
        steps.append(threading.current_thread().name)
        return original(self)

    monkeypatch.setattr(engine_module.Engine, "step", step)
    target, draft, _ = tiny_pair
    srv = Server(
        ServeOptions(
            target=str(target), draft=str(draft), gamma=2, traffic=str(tmp_path / "traffic")
        )
    )
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


def test_serve_sets_threads_as_asked_or_from_the_free_cores(monkeypatch, caplog):
    """--threads is kept; without it the free cores are measured (specdistill/threads.py)
    and said, and the policy goes to the engine worker; on a GPU nothing is set."""
    import logging

    import torch

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # else a forced count
    with caplog.at_level(logging.INFO, logger="specdistill.serve"):
        forced = serve_cli.set_threads(3, "cpu")  # --threads
        chosen = serve_cli.set_threads(None, "cpu")
        assert serve_cli.set_threads(None, "cuda") is None
    assert forced.threads == 3 and calls[0] == 3 and calls[1] == chosen.threads >= 1
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == "threads: 3 (--threads)" and said[1].startswith(
        f"threads: {chosen.threads} of "
    )


def test_the_engine_worker_rechecks_the_threads_between_rounds(tiny_pair, tmp_path):
    from specdistill.serve.options import ServeOptions
    from specdistill.serve.server import Server

    class Policy:
        rechecks = 0

        def recheck(self, say=None):
            Policy.rechecks += 1

    target, draft, _ = tiny_pair
    srv = Server(ServeOptions(target=str(target), draft=str(draft), gamma=2), threads=Policy())
    try:
        url = srv.start()
        body = {"model": str(target), "prompt": "def", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        srv.stop()
    assert Policy.rechecks >= 2  # each round of the request's decoding
