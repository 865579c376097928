"""A hostile client against `specdistill serve`: every request is bounded, validated and
answered in OpenAI's error shape; keys guard /v1/*; SIGTERM drains and exits."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from specdistill.formats.traffic import validate
from specdistill.formats.traffic_shards import read_traffic
from tests.processes import free_port

KEYS = ("key-one", "key-two")
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def hostile(tiny_pair, tmp_path_factory):
    """(base URL, Server): two API keys, a traffic log, max-model-len the target's (128)."""
    from specdistill.serve.options import ServeOptions
    from specdistill.serve.server import Server

    target, draft, _ = tiny_pair
    srv = Server(
        ServeOptions(
            target=str(target),
            draft=str(draft),
            gamma=2,
            max_num_seqs=2,
            traffic=str(tmp_path_factory.mktemp("traffic_hostile")),
            served_model_name="tiny",
            api_key=",".join(KEYS),
        )
    )
    url = srv.start()
    yield url, srv
    srv.stop()


@pytest.fixture(scope="module")
def hostile_client(hostile):
    """A client of the `hostile` server, sending the second of its two API keys."""
    with httpx.Client(
        base_url=hostile[0], headers={"Authorization": f"Bearer {KEYS[1]}"}, timeout=60
    ) as client:
        yield client


def error_of(response, status: int) -> dict:
    """The OpenAI error object of a response with `status` (and nothing else in the body)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status
    return body["error"]


def post_raw(client, path: str, raw: bytes):
    return client.post(path, content=raw, headers={"Content-Type": "application/json"})


class CountingTokenizer:
    """The server's tokenizer, counting the calls that tokenise text."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.calls += 1
        return self.inner.apply_chat_template(*args, **kwargs)

    def __len__(self):
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def counting(hostile):
    state = hostile[1].state
    original = state.tokenizer
    state.tokenizer = CountingTokenizer(original)
    yield state.tokenizer
    state.tokenizer = original


# ----------------------------------------------------------------------------- limits


def test_body_over_the_cap_is_413_with_content_length(hostile_client, counting):
    raw = json.dumps({"prompt": "x" * (2 << 20), "max_tokens": 1}).encode()
    e = error_of(post_raw(hostile_client, "/v1/completions", raw), 413)
    assert str(1 << 20) in e["message"]
    assert counting.calls == 0


def test_chunked_body_over_the_cap_is_413(hostile_client, counting):
    def chunks():  # no Content-Length: sent chunked
        yield b'{"prompt": "'
        for _ in range(64):
            yield b"x" * 65536
        yield b'"}'

    r = hostile_client.post(
        "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert "content-length" not in r.request.headers
    error_of(r, 413)
    assert counting.calls == 0


def test_prompt_chars_refused_before_tokenising(hostile_client, hostile, counting):
    """A prompt far beyond the context (but within the body cap) is refused by its length in
    characters: the tokenizer never sees it, so one request's memory and CPU stay bounded."""
    cap = hostile[1].limits.max_prompt_chars
    r = hostile_client.post("/v1/completions", json={"prompt": "x" * (cap + 1), "max_tokens": 1})
    e = error_of(r, 400)
    assert e["param"] == "prompt" and str(cap) in e["message"]
    r = hostile_client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "y" * (cap // 2 + 1)}] * 2},
    )
    assert error_of(r, 400)["param"] == "messages"
    assert counting.calls == 0


def test_prompt_beyond_max_model_len_names_both_numbers(hostile_client, hostile):
    tok = hostile[1].tokenizer
    prompt = PROMPT * 40
    n = len(tok(prompt)["input_ids"])
    assert 128 < n < hostile[1].limits.max_prompt_chars
    e = error_of(hostile_client.post("/v1/completions", json={"prompt": prompt}), 400)
    assert "maximum context length is 128 tokens" in e["message"] and str(n) in e["message"]
    n_short = len(tok(PROMPT)["input_ids"])
    r = hostile_client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 128})
    e = error_of(r, 400)
    assert e["param"] == "max_tokens"
    assert f"you requested {n_short + 128} tokens ({n_short} in the prompt, 128" in e["message"]


def test_max_tokens_1e9_is_400(hostile_client):
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        e = error_of(hostile_client.post(path, json={**body, "max_tokens": 10**9}), 400)
        assert "128" in e["message"] and str(10**9) in e["message"]


def test_no_max_tokens_gets_the_room_left(hostile_client, hostile):
    tok = hostile[1].tokenizer
    prompt = PROMPT
    while len(tok(prompt + PROMPT)["input_ids"]) < 128:
        prompt += PROMPT
    n = len(tok(prompt)["input_ids"])
    assert 128 - 16 < n < 128  # less room than the default 16 tokens
    r = hostile_client.post("/v1/completions", json={"prompt": prompt, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 128 - n


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "x", "temperature": NaN}',
        b'{"prompt": "x", "temperature": Infinity}',
        b'{"prompt": "x", "top_p": NaN}',
        b'{"prompt": "x", "top_p": -Infinity}',
        b'{"prompt": "x", "max_tokens": NaN}',
        b'{"prompt": "x", "max_tokens": 1e400}',
        b'{"prompt": "x", "n": 1e400}',
        b'{"prompt": "x", "temperature": 1e400}',
        b'{"prompt": "x", "seed": 1e400}',
    ],
)
def test_non_finite_numbers_are_400_naming_the_field(hostile_client, raw):
    field = raw.split(b'"')[5].decode()
    e = error_of(post_raw(hostile_client, "/v1/completions", raw), 400)
    assert e["param"] == field and field in e["message"]


def test_deep_nesting_is_400(hostile_client, counting):
    raw = b'{"prompt": "x", "metadata": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    e = error_of(post_raw(hostile_client, "/v1/completions", raw), 400)
    assert "nests deeper" in e["message"]
    raw = b"[" * 100_000  # not even JSON
    error_of(post_raw(hostile_client, "/v1/completions", raw), 400)
    assert counting.calls == 0


def test_twenty_thousand_messages_are_400_before_tokenising(hostile_client, counting):
    messages = [{"role": "user", "content": "hello there"}] * 20_000
    r = hostile_client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    e = error_of(r, 400)
    assert e["param"] == "messages" and "20000" in e["message"]
    assert counting.calls == 0


def test_too_many_or_too_long_stop_strings_are_400(hostile_client):
    for stop in (["a"] * 17, ["b" * 257]):
        r = hostile_client.post("/v1/completions", json={"prompt": PROMPT, "stop": stop})
        assert error_of(r, 400)["param"] == "stop"


# ----------------------------------------------------------------------------- shape


def test_wrong_method_and_unknown_path_are_openai_shaped(hostile_client, hostile):
    e = error_of(hostile_client.get("/v1/completions"), 405)
    assert "GET" in e["message"]
    e = error_of(hostile_client.post("/v1/nothing", json={}), 404)
    assert "/v1/nothing" in e["message"]
    error_of(httpx.get(hostile[0] + "/nowhere"), 404)
    e = error_of(post_raw(hostile_client, "/v1/completions", b"{not json"), 400)
    e = error_of(post_raw(hostile_client, "/v1/completions", b'["a list"]'), 400)
    e = error_of(hostile_client.post("/v1/completions", json={"max_tokens": 2}), 400)
    assert e["param"] == "prompt"
    e = error_of(
        hostile_client.post("/v1/completions", json={"prompt": "x", "temperature": "hot"}), 400
    )
    assert e["param"] == "temperature"


def test_unknown_model_is_404_and_absent_model_is_the_served_one(hostile_client):
    e = error_of(
        hostile_client.post("/v1/completions", json={"model": "gpt-4", "prompt": PROMPT}), 404
    )
    assert e["message"] == "The model `gpt-4` does not exist." and e["param"] == "model"
    for body in ({"model": "tiny"}, {}):
        r = hostile_client.post("/v1/completions", json={**body, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "tiny"


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "echo", True),
        ("/v1/completions", "suffix", "tail"),
        ("/v1/completions", "logit_bias", {"5": 10}),
        ("/v1/completions", "presence_penalty", 0.5),
        ("/v1/completions", "frequency_penalty", -1),
        ("/v1/completions", "best_of", 2),
        ("/v1/completions", "n", 2),
        ("/v1/completions", "top_k", 5),  # not an OpenAI field: unknown fields are refused
        ("/v1/chat/completions", "response_format", {"type": "json_object"}),
        ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
        ("/v1/chat/completions", "tool_choice", "auto"),
        ("/v1/chat/completions", "functions", [{"name": "f"}]),
        ("/v1/chat/completions", "logit_bias", {"5": 10}),
    ],
)
def test_unsupported_fields_are_400_naming_the_field(hostile_client, path, field, value):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    body = {"prompt": PROMPT} if path == "/v1/completions" else chat
    e = error_of(hostile_client.post(path, json={**body, field: value, "max_tokens": 2}), 400)
    assert e["param"] == field and e["message"].startswith(field)


def test_neutral_values_of_unsupported_fields_are_accepted(hostile_client):
    r = hostile_client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 2,
            "response_format": {"type": "text"},
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "logit_bias": {},
            "tools": [],
            "tool_choice": "none",
            "user": "someone",
            "n": 1,
        },
    )
    assert r.status_code == 200, r.text
    r = hostile_client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "echo": False, "best_of": 1}
    )
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------- keys


def test_keys_guard_v1_and_health_metrics_stay_open(hostile):
    url = hostile[0]
    body = {"prompt": PROMPT, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEYS[0]}):
        for r in (
            httpx.post(url + "/v1/completions", json=body, headers=headers),
            httpx.get(url + "/v1/models", headers=headers),
        ):
            e = error_of(r, 401)
            assert "Authorization: Bearer" in e["message"]
    for key in KEYS:
        r = httpx.post(
            url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        assert r.status_code == 200
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200


def test_records_name_the_client_key(hostile_client, hostile, server):
    r = hostile_client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    records = {x["id"]: x for x in read_traffic(hostile[1].traffic.dir)}
    expected = "key-" + hashlib.sha256(KEYS[1].encode()).hexdigest()[:12]
    assert records[r.json()["id"]]["client"] == expected
    # a server without keys records null; a record without the field stays valid
    r = httpx.post(server[0] + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    keyless = {x["id"]: x for x in read_traffic(server[1].traffic.dir)}[r.json()["id"]]
    assert keyless["client"] is None
    del keyless["client"]
    validate(keyless)


def test_non_loopback_bind_without_key_is_refused(tiny_pair, server, capsys):
    from specdistill.errors import run_guarded
    from specdistill.serve.serve_cli import main

    target, draft, _ = tiny_pair
    argv = ["--target", str(target), "--draft", str(draft), "--host", "0.0.0.0", "--port", "1"]
    env = os.environ.pop("SPECDISTILL_API_KEY", None)
    try:
        assert run_guarded(main, argv) == 2
    finally:
        if env is not None:
            os.environ["SPECDISTILL_API_KEY"] = env
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--api-key" in err and "--insecure" in err
    with pytest.raises(ValueError, match="without an API key"):
        server[1].start("0.0.0.0", 0)  # the keyless server of conftest.py


# ----------------------------------------------------------------------------- load


@pytest.fixture(scope="module")
def small(tiny_pair):
    """One row, one queued request; long contexts so requests outlast the test's steps."""
    from specdistill.serve.options import ServeOptions
    from specdistill.serve.server import Server

    target, draft, _ = tiny_pair
    srv = Server(
        ServeOptions(
            target=str(target),
            draft=str(draft),
            gamma=2,
            max_num_seqs=1,
            max_queue=1,
            max_model_len=100_000,
            served_model_name="tiny",
        )
    )
    url = srv.start()
    yield url, srv
    srv.stop()


def wait_idle(srv, deadline_s: float = 20) -> None:
    deadline = time.monotonic() + deadline_s
    while (srv.worker.current.busy or srv.state.in_flight) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not srv.worker.current.busy and srv.state.in_flight == 0


def test_full_queue_answers_503_with_retry_after(small):
    url, srv = small
    body = {"prompt": PROMPT, "max_tokens": 50_000, "temperature": 0, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as a, httpx.Client(base_url=url, timeout=60) as b:
        with a.stream("POST", "/v1/completions", json=body) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # kept: a closed iterator closes the response
            next(lines)  # decoding: the one row
            with b.stream("POST", "/v1/completions", json=body) as queued:
                assert queued.status_code == 200  # admitted, waiting for the row
                assert srv.state.in_flight == 2
                r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
                e = error_of(r, 503)
                assert r.headers["retry-after"] == "1" and "capacity" in e["message"]
    wait_idle(srv)  # both clients left: their rows and slots are free again
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200


def test_gone_non_streaming_client_frees_its_row(small):
    url, srv = small
    body = {"prompt": PROMPT, "max_tokens": 50_000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=3))
    wait_idle(srv)  # the server noticed the client leaving and freed the row


# ----------------------------------------------------------------------------- drain


def test_sigterm_drains_and_exits_zero(tiny_pair, tmp_path):
    """SIGTERM while a long stream runs: the server stops accepting, the stream completes or
    is cut within --drain-s, and the process exits 0 (within the wait's bound)."""
    target, draft, _ = tiny_pair
    port = free_port()
    cmd = [sys.executable, "-m", "specdistill", "serve", "--target", str(target)]
    cmd += ["--draft", str(draft), "--port", str(port), "--drain-s", "2", "--threads", "1"]
    cmd += ["--max-model-len", "100000", "--traffic", str(tmp_path / "traffic")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        body = {"prompt": PROMPT, "max_tokens": 5000, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            try:
                for _ in lines:  # to its end, or cut when the drain time is up
                    pass
            except httpx.HTTPError:
                pass
        rc = proc.wait(timeout=60)
        with pytest.raises(httpx.TransportError):  # no longer accepting
            httpx.get(url + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = proc.stdout.read().decode()
    assert rc == 0, output[-3000:]
