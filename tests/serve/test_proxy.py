"""The logging proxy (serve/proxy.py): every answered request logged whole, in the form
convert-traffic reads; the engine behind it swapped without a client's request failing; its
bounds and errors OpenAI-shaped. The engines here are small standard-library HTTP servers
that answer like vLLM's completions endpoint."""

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specdistill.serve.proxy import LoggingProxy
from specdistill.serve.vllm_server import free_port


def fake_engine(name: str, delay: float = 0.0, status: int = 200):
    """(server, url): an engine answering each POST with its name and the prompt, after
    `delay` seconds, with `status`."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(delay)
            answer = json.dumps(
                {"id": f"{name}-{body['prompt']}", "engine": name, "choices": [{"text": "x"}]}
                if status == 200
                else {"error": {"message": "bad", "code": status}}
            ).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def post(url: str, body, path: str = "/v1/completions", raw: bytes | None = None):
    """(status, JSON body) of a POST to the proxy."""
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method="POST")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def proxied(tmp_path):
    engines = [fake_engine("a"), fake_engine("b")]
    proxy = LoggingProxy(engines[0][1], tmp_path / "log.jsonl", max_body=2000, retry_s=5)
    url = proxy.start()
    yield proxy, url, engines, tmp_path / "log.jsonl"
    proxy.stop()
    for server, _ in engines:
        server.shutdown()


def test_an_answered_request_is_logged_whole(proxied):
    proxy, url, _, log = proxied
    status, answer = post(url, {"model": "m", "prompt": [1, 2], "logprobs": 5})
    assert status == 200 and answer["engine"] == "a"
    (line,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert line["request"] == {"model": "m", "prompt": [1, 2], "logprobs": 5}
    assert line["response"] == answer and line["upstream"] == proxy.upstream


def test_a_switch_sends_new_requests_to_the_new_engine(proxied):
    proxy, url, engines, log = proxied
    proxy.switch(engines[1][1])
    assert post(url, {"prompt": 1})[1]["engine"] == "b"
    assert proxy.drain(engines[0][1], 1.0)


def test_no_request_fails_while_the_engine_is_swapped(tmp_path):
    slow, slow_url = fake_engine("old", delay=0.3)
    proxy = LoggingProxy(slow_url, tmp_path / "log.jsonl", retry_s=10)
    url = proxy.start()
    results, stop = [], threading.Event()

    def client(i: int):
        n = 0
        while not stop.is_set():
            results.append(post(url, {"prompt": f"{i}-{n}"}))
            n += 1

    clients = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for c in clients:
        c.start()
    time.sleep(0.5)
    new, new_url = fake_engine("new")
    proxy.switch(new_url)
    assert proxy.drain(slow_url, 5.0)  # the old engine's requests finished there
    slow.shutdown()
    slow.server_close()  # gone: a request still aimed at it would be refused
    time.sleep(0.5)
    stop.set()
    for c in clients:
        c.join()
    assert all(status == 200 for status, _ in results), [r for r in results if r[0] != 200][:3]
    engines = {answer["engine"] for _, answer in results}
    assert engines == {"old", "new"}
    log_lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert len(log_lines) == len(results) == proxy.counts["logged"]
    assert len({json.loads(x)["response"]["id"] for x in log_lines}) == len(results)
    proxy.stop()
    new.shutdown()


def test_a_refused_connection_is_retried_on_the_current_engine(tmp_path):
    gone, gone_url = fake_engine("gone")
    gone.shutdown()
    gone.server_close()
    alive, alive_url = fake_engine("alive")
    proxy = LoggingProxy(gone_url, tmp_path / "log.jsonl", retry_s=10)
    url = proxy.start()
    threading.Timer(1.0, proxy.switch, args=(alive_url,)).start()
    status, answer = post(url, {"prompt": 1})
    assert status == 200 and answer["engine"] == "alive" and proxy.counts["retries"] >= 1
    proxy.stop()
    alive.shutdown()


def test_no_engine_at_all_is_a_502_once_the_retries_run_out(tmp_path):
    gone, gone_url = fake_engine("gone")
    gone.shutdown()
    gone.server_close()
    proxy = LoggingProxy(gone_url, tmp_path / "log.jsonl", retry_s=1)
    url = proxy.start()
    status, answer = post(url, {"prompt": 1})
    assert status == 502 and answer["error"]["code"] == 502
    assert not (tmp_path / "log.jsonl").exists()
    proxy.stop()


@pytest.mark.parametrize(
    "raw, path, status, words",
    [
        (b"x" * 3000, "/v1/completions", 413, "larger than 2000"),
        (b"{not json", "/v1/completions", 400, "not JSON"),
        (b"[1, 2]", "/v1/completions", 400, "JSON object"),
        (b'{"prompt": 1, "stream": true}', "/v1/completions", 400, "stream"),
        (b"{}", "/v1/embeddings", 404, "no route"),
    ],
)
def test_bad_requests_get_openai_shaped_errors_and_are_not_logged(
    proxied, raw, path, status, words
):
    _, url, _, log = proxied
    got, answer = post(url, None, path, raw)
    assert got == status and words in answer["error"]["message"]
    assert answer["error"]["code"] == status and answer["error"]["type"]
    assert not log.exists()


def test_the_engines_own_errors_pass_through_unlogged(tmp_path):
    engine, engine_url = fake_engine("e", status=400)
    proxy = LoggingProxy(engine_url, tmp_path / "log.jsonl")
    url = proxy.start()
    status, answer = post(url, {"prompt": 1})
    assert status == 400 and answer["error"]["message"] == "bad"
    assert not (tmp_path / "log.jsonl").exists()
    proxy.stop()
    engine.shutdown()


def test_more_requests_than_the_limit_are_refused_with_503(tmp_path):
    slow, slow_url = fake_engine("slow", delay=2.0)
    proxy = LoggingProxy(slow_url, tmp_path / "log.jsonl", max_in_flight=1)
    url = proxy.start()
    first = threading.Thread(target=post, args=(url, {"prompt": 1}))
    first.start()
    deadline = time.monotonic() + 20
    while proxy.in_flight(slow_url) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    status, answer = post(url, {"prompt": 2})
    first.join()
    assert status == 503 and "limit" in answer["error"]["message"]
    proxy.stop()
    slow.shutdown()


def test_the_proxy_verb_logs_until_sigterm(tmp_path):
    engine, engine_url = fake_engine("e")
    port = free_port()
    log = tmp_path / "log.jsonl"
    argv = [sys.executable, "-m", "specdistill", "proxy", "--upstream", engine_url]
    proc = subprocess.Popen(
        [*argv, "--log", str(log), "--port", str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert "proxy on" in proc.stdout.readline()
        status, answer = post(f"http://127.0.0.1:{port}", {"prompt": 7})
        assert status == 200 and answer["id"] == "e-7"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "'logged': 1" in out
    assert json.loads(log.read_text())["request"] == {"prompt": 7}
    engine.shutdown()


def test_the_proxy_verb_refuses_a_bad_upstream(tmp_path):
    argv = [sys.executable, "-m", "specdistill", "proxy", "--upstream", "localhost:1"]
    proc = subprocess.run([*argv, "--log", str(tmp_path / "x")], capture_output=True, text=True)
    assert proc.returncode == 2 and "http(s) URL" in proc.stderr
