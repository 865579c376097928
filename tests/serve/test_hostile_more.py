"""More hostile clients and flags against `specdistill serve`: lone surrogates, loose booleans,
subnormal temperatures, slow bodies, empty keys, the OpenAPI pages, and options out of range
refused before any model loads."""

import asyncio
import json
import socket
import time

import httpx
import pytest
import torch

from specdistill.formats.traffic_shards import read_traffic

KEY = "key-more"
PROMPT = "def add(a, b):"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def keyed(tiny_pair, tmp_path_factory):
    """(base URL, Server): one key, a traffic log, two admission slots, a short body timeout."""
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
            traffic=str(tmp_path_factory.mktemp("traffic_more")),
            served_model_name="tiny",
            api_key=KEY,
            body_timeout_s=BODY_TIMEOUT_S,
        )
    )
    url = srv.start()
    yield url, srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed_client(keyed):
    """A client of the `keyed` server, sending its API key."""
    with httpx.Client(base_url=keyed[0], headers=AUTH, timeout=60) as client:
        yield client


def error_of(response, status: int) -> dict:
    """The OpenAI error object of a response with `status` (and nothing else in the body)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    return body["error"]


def post_raw(client, path: str, raw: bytes):
    return client.post(path, content=raw, headers={"Content-Type": "application/json"})


def record_count(srv) -> int:
    return len(list(read_traffic(srv.traffic.dir)))


# ----------------------------------------------------------------------------- surrogates


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", rb'{"prompt": "\ud800 hi", "max_tokens": 2}', "prompt"),
        ("/v1/completions", rb'{"prompt": ["\udfff"], "max_tokens": 2}', "prompt.0"),
        ("/v1/completions", rb'{"prompt": "hi", "stop": "\uDBFF", "max_tokens": 2}', "stop"),
        ("/v1/completions", rb'{"prompt": "hi", "stop": ["a", "\ud800"]}', "stop.1"),
        ("/v1/completions", rb'{"prompt": "hi", "user": "\ude00\ud83d"}', "user"),
        ("/v1/completions", rb'{"prompt": "hi", "metadata": {"\ud800": 1}}', "metadata"),
        (
            "/v1/chat/completions",
            rb'{"messages": [{"role": "user", "content": "\ud800 hi"}], "max_tokens": 2}',
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}',
            "messages.0.content.0.text",
        ),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(keyed_client, keyed, path, raw, param):
    before = record_count(keyed[1])
    e = error_of(post_raw(keyed_client, path, raw), 400)
    assert e["type"] == "invalid_request_error"
    assert e["param"] == param and "surrogate" in e["message"]
    assert record_count(keyed[1]) == before


def test_a_surrogate_pair_and_an_escaped_backslash_u_are_text(keyed_client, keyed):
    before = record_count(keyed[1])
    for raw in (
        rb'{"prompt": "\ud83d\ude00 hi", "stop": ["\ud83d\ude00"], "max_tokens": 2}',
        rb'{"prompt": "\\ud800 is six characters", "max_tokens": 2}',
    ):
        r = post_raw(keyed_client, "/v1/completions", raw)
        assert r.status_code == 200, r.text
    assert record_count(keyed[1]) == before + 2  # both written to the traffic log


# ----------------------------------------------------------------------------- booleans


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", {"stream": "yes"}, "stream"),
        ("/v1/completions", {"stream": 1}, "stream"),
        ("/v1/completions", {"stream": "true"}, "stream"),
        ("/v1/completions", {"stream": 0}, "stream"),
        (
            "/v1/completions",
            {"stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
        ),
        ("/v1/completions", {"echo": "false"}, "echo"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
        ("/v1/chat/completions", {"stream": "on"}, "stream"),
    ],
)
def test_booleans_must_be_json_booleans(keyed_client, path, fields, param):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    body = {"prompt": PROMPT} if path == "/v1/completions" else chat
    e = error_of(keyed_client.post(path, json={**body, **fields, "max_tokens": 2}), 400)
    assert e["param"] == param and "boolean" in e["message"]


# ----------------------------------------------------------------------------- temperature


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, 1e-6])
def test_a_tiny_temperature_decodes_greedily(keyed_client, keyed, temperature):
    body = {"prompt": PROMPT, "max_tokens": 12, "seed": 3}
    greedy = keyed_client.post("/v1/completions", json={**body, "temperature": 0})
    tiny = keyed_client.post("/v1/completions", json={**body, "temperature": temperature})
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    records = {r["id"]: r for r in read_traffic(keyed[1].traffic.dir)}
    assert records[tiny.json()["id"]]["sampling"]["temperature"] == 0  # what was served


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, 1e-6])
def test_the_engine_samplers_are_argmax_at_a_tiny_temperature(temperature):
    from types import SimpleNamespace

    from specdistill.eval.sampling import RowSampler, Sampler, Sampling

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 5
    best = logits.argmax(-1)
    sampler = Sampler(temperature, None, None, torch.Generator().manual_seed(1))
    assert torch.equal(sampler.target(logits)[0], best)
    assert torch.equal(sampler.draft(logits)[0], best)
    rows_sampler = RowSampler(torch.device("cpu"))
    sampling = Sampling(temperature, seed=1)
    rows = [SimpleNamespace(sampling=sampling, generator=rows_sampler.generator_for(sampling))]
    rows *= 3
    assert torch.equal(rows_sampler.target(logits, rows)[0], best)


# ----------------------------------------------------------------------------- slow bodies


def _half_sender(host: str, port: int) -> socket.socket:
    """A connection that sends its headers and half its body, then nothing."""
    sock = socket.create_connection((host, port), timeout=10)
    head = (
        "POST /v1/completions HTTP/1.1\r\n"
        f"Host: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    sock.sendall(head.encode() + b'{"prompt": "half')
    return sock


def test_slow_bodies_hold_no_slot_and_time_out_with_408(keyed_client, keyed):
    """More half-sent bodies than admission slots: others are still served at once, and each
    slow sender gets a 408 once --body-timeout-s has passed."""
    url, srv = keyed
    host, port = url.removeprefix("http://").split(":")
    senders = [_half_sender(host, int(port)) for _ in range(4 * srv.state.capacity)]
    try:
        time.sleep(0.3)  # the server has read every header and the halves
        start = time.monotonic()
        r = keyed_client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert time.monotonic() - start < BODY_TIMEOUT_S
        for sock in senders:
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                answer += chunk
            head, _, payload = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), answer
            assert json.loads(payload)["error"]["code"] == 408
        assert time.monotonic() - start < BODY_TIMEOUT_S + 5
    finally:
        for sock in senders:
            sock.close()
    assert srv.state.in_flight == 0 and srv.state.bodies.held == 0


class _Request:
    """Enough of a Starlette request for `BodyReader`: headers and a body stream that sends
    `first`, then waits for `go` before sending `rest`."""

    def __init__(self, first: bytes, rest: bytes, go: asyncio.Event):
        self.headers: dict[str, str] = {}
        self.first, self.rest, self.go = first, rest, go

    async def stream(self):
        yield self.first
        await self.go.wait()
        yield self.rest


def test_bodies_being_read_stay_within_their_byte_budget():
    from specdistill.serve.errors import APIError
    from specdistill.serve.intake import BodyReader

    async def scenario():
        reader = BodyReader(max_body_bytes=100, timeout_s=5, budget_bytes=100)
        go = asyncio.Event()
        slow = asyncio.ensure_future(reader.read(_Request(b"a" * 60, b"b" * 10, go)))
        await asyncio.sleep(0.01)
        assert reader.held == 60
        with pytest.raises(APIError) as e:  # 60 + 50 held at once: over the budget
            await reader.read(_Request(b"c" * 50, b"", asyncio.Event()))
        assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
        assert reader.held == 60
        go.set()
        assert await slow == b"a" * 60 + b"b" * 10
        assert reader.held == 0

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- keys


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_the_openapi_pages_need_the_key(keyed, path):
    url = keyed[0]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        error_of(httpx.get(url + path, headers=headers), 401)
    assert httpx.get(url + path, headers=AUTH).status_code == 200


@pytest.fixture
def no_loading(monkeypatch):
    """Loading a tokenizer or a model fails the test: the checks must come first."""
    import specdistill.models.hub as hub

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(hub, "load_tokenizer", refuse)
    monkeypatch.setattr(hub, "load_target", refuse)
    monkeypatch.delenv("SPECDISTILL_API_KEY", raising=False)


def run_serve(tiny_pair, extra: list[str], capsys) -> tuple[int, str]:
    from specdistill.errors import run_guarded
    from specdistill.serve.serve_cli import main

    target, draft, _ = tiny_pair
    rc = run_guarded(main, ["--target", str(target), "--draft", str(draft), *extra])
    return rc, capsys.readouterr().err.strip()


@pytest.mark.parametrize("value", ["", ",", " ", "good,,other", "good, "])
def test_an_empty_api_key_is_refused(tiny_pair, no_loading, capsys, value):
    rc, err = run_serve(tiny_pair, ["--api-key", value], capsys)
    assert rc == 2 and len(err.splitlines()) == 1 and "--api-key" in err and "empty" in err
    assert "good" not in err  # keys are never echoed


def test_an_empty_api_key_in_the_environment_or_the_api_is_refused(
    tiny_pair, no_loading, capsys, monkeypatch
):
    from specdistill.errors import UserError
    from specdistill.serve.options import ServeOptions
    from specdistill.serve.server import Server

    monkeypatch.setenv("SPECDISTILL_API_KEY", "")
    rc, err = run_serve(tiny_pair, [], capsys)
    assert rc == 2 and len(err.splitlines()) == 1 and "SPECDISTILL_API_KEY" in err
    with pytest.raises(UserError, match="empty API key"):
        Server(ServeOptions(target=str(tiny_pair[0]), draft="none", api_key=","))


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--max-prompt-chars", "-5"], "--max-prompt-chars"),
        (["--traffic-shard-mb", "-1"], "--traffic-shard-mb"),
        (["--traffic-shard-mb", "nan"], "--traffic-shard-mb"),
        (["--poll-s", "0"], "--poll-s"),
        (["--port", "99999"], "--port"),
        (["--port", "-1"], "--port"),
        (["--device", "evil"], "--device"),
        (["--threads", "0"], "--threads"),
        (["--body-timeout-s", "0"], "--body-timeout-s"),
        (["--drain-s", "inf"], "--drain-s"),
        (["--max-model-len", "1"], "--max-model-len"),
    ],
)
def test_options_out_of_range_are_one_line_before_loading(
    tiny_pair, no_loading, capsys, extra, named
):
    rc, err = run_serve(tiny_pair, extra, capsys)
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and named in err and extra[1] in err


def test_a_file_where_the_traffic_directory_belongs_is_refused(
    tiny_pair, no_loading, capsys, tmp_path
):
    file = tmp_path / "traffic"
    file.write_text("not a directory")
    for path in (file, file / "below"):
        rc, err = run_serve(tiny_pair, ["--traffic", str(path)], capsys)
        assert rc == 2 and len(err.splitlines()) == 1
        assert "--traffic" in err and "not a directory" in err
    assert file.read_text() == "not a directory"
