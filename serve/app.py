"""The OpenAI-compatible HTTP side: FastAPI routes, SSE streaming, /metrics, traffic records.

Handlers parse a request, submit a `Job` to the engine worker (serve/worker.py) and read
its events from their own asyncio queue: decoding never runs on the event loop, and a slow
or gone client only concerns its own queue (a gone one is cancelled, freeing its row).

Responses carry OpenAI's fields plus `metrics.speculative_decoding` (vLLM's per-request
shape) and `draft_version`. Log-probabilities are the target's, from its raw logits
(temperature 1, no top-p), of each generated token, as vLLM reports them by default.
"""

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from specdistill.eval.engine import Sampling
from specdistill.serve.traffic import SCHEMA_VERSION, TrafficLog
from specdistill.serve.worker import EngineWorker, Job

log = logging.getLogger("specdistill.serve")
MAX_TOP_LOGPROBS = 20
PREFIX = "specdistill:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class BadRequest(ValueError):
    pass


@dataclass
class ServerConfig:
    model_name: str  # what /v1/models lists and responses name
    target_name: str
    target_identity: str
    default_max_tokens: int = 16
    log_top_logprobs: int = 0  # top-k target logprobs per token in the traffic log


class Metrics:
    """Prometheus metrics with vLLM's meanings, in a registry of their own (one per app)."""

    def __init__(self):
        disable_created_metrics()  # no `_created` series next to each counter
        r = self.registry = CollectorRegistry()
        self.num_drafts = Counter(
            PREFIX + "spec_decode_num_drafts",
            "Speculative rounds (one draft each) per row.",
            registry=r,
        )
        self.num_draft_tokens = Counter(
            PREFIX + "spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r
        )
        self.num_accepted_tokens = Counter(
            PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r
        )
        self.accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0-based).",
            ["position"],
            registry=r,
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens.", registry=r
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens.", registry=r)
        self.request_success = Counter(
            PREFIX + "request_success", "Completed requests.", ["finished_reason"], registry=r
        )
        self.latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Request latency (arrival to last token).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge(PREFIX + "num_requests_running", "Requests in flight.", registry=r)
        self.draft_version = Gauge(
            PREFIX + "draft_version",
            "Published draft version number (0: none or unversioned).",
            registry=r,
        )
        self.draft_info = Gauge(
            PREFIX + "draft_version_info",
            "The draft version serving new requests (value 1).",
            ["version"],
            registry=r,
        )

    def finished(self, stats: dict, n_prompt: int, n_out: int, reason: str, latency, ttft):
        self.num_drafts.inc(stats["num_spec_steps"])
        self.num_draft_tokens.inc(stats["num_draft_tokens"])
        self.num_accepted_tokens.inc(stats["num_accepted_draft_tokens"])
        for pos, n in enumerate(stats["acceptance_histogram"]):
            self.accepted_per_pos.labels(position=str(pos)).inc(n)
        self.generation_tokens.inc(n_out)
        self.prompt_tokens.inc(n_prompt)
        self.request_success.labels(finished_reason=reason).inc()
        self.latency.observe(latency)
        if ttft is not None:
            self.ttft.observe(ttft)

    def expose(self, version: str | None) -> bytes:
        self.draft_version.set(int(version[1:]) if version and _is_version(version) else 0)
        self.draft_info.clear()
        self.draft_info.labels(version=version or "none").set(1)
        return generate_latest(self.registry)


def _is_version(v: str) -> bool:
    return len(v) == 7 and v[0] == "v" and v[1:].isdigit()


# ----------------------------------------------------------------------------- text


class TextTracker:
    """Incremental detokenisation with stop strings: the text safe to send so far.

    Holds back a trailing partial character and any tail that could begin a stop string;
    when a stop string appears the text is cut before it and `stopped` is set.
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.ids: list[int] = []
        self.sent = 0
        self.text = ""
        self.stopped = False
        self.n_tokens = 0  # tokens whose text is kept (all, unless a stop string cut them)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, tokens: list[int], final: bool = False) -> str:
        self.ids += tokens
        self.n_tokens = len(self.ids)
        text = self._decode(self.ids)
        hits = [i for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            cut = min(hits)
            self.stopped = True
            n = len(self.ids)
            while n > 0 and len(self._decode(self.ids[: n - 1])) >= cut:
                n -= 1
            self.n_tokens = n
            self.text = text[:cut]
            delta = text[self.sent : cut]
            self.sent = max(self.sent, cut)
            return delta
        hold = 0
        if not final:
            if text.endswith("\ufffd"):
                hold = 1
            for s in self.stops:
                for k in range(min(len(s) - 1, len(text)), hold, -1):
                    if text.endswith(s[:k]):
                        hold = k
                        break
        self.text = text
        safe = len(text) - hold
        delta = text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return delta


# ----------------------------------------------------------------------------- requests


@dataclass
class Parsed:
    chat: bool
    prompt_ids: list[int]
    prompt: object  # text or messages, for the traffic record
    max_tokens: int
    sampling: Sampling
    stops: list[str]
    logprobs: int | None  # top-k the client asked for (None: no logprobs)
    stream: bool
    include_usage: bool
    category: str | None
    seed: int | None


def _number(body, key, default, kind=float, low=None, high=None):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{key} must be a number")
    if kind is int and int(value) != value:
        raise BadRequest(f"{key} must be an integer")
    value = kind(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise BadRequest(f"{key} must be in [{low}, {high}], got {value}")
    return value


def parse(body: dict, tokenizer, config: ServerConfig, chat: bool) -> Parsed:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if _number(body, "n", 1, int) != 1:
        raise BadRequest("only n=1 is supported")
    if body.get("best_of") not in (None, 1):
        raise BadRequest("best_of is not supported")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
                raise BadRequest("each message needs a role and a string content")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompt = [{"role": m["role"], "content": m["content"]} for m in messages]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = tokenizer(prompt)["input_ids"]
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            prompt_ids = list(prompt)
            if max(prompt_ids) >= len(tokenizer) or min(prompt_ids) < 0:
                raise BadRequest("prompt token ids out of the vocabulary")
            prompt = tokenizer.decode(prompt_ids)
        else:
            raise BadRequest("prompt must be a string, or a list of token ids (one prompt)")
    if not prompt_ids:
        raise BadRequest("the prompt encodes to no tokens")
    default_max = config.default_max_tokens
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") else "max_tokens"
    max_tokens = _number(body, key, default_max, int, low=1)
    temperature = _number(body, "temperature", 1.0, float, low=0.0, high=100.0)
    top_p = _number(body, "top_p", 1.0, float, low=0.0, high=1.0)
    if top_p <= 0:
        raise BadRequest("top_p must be > 0")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("seed must be an integer")
    stops = body.get("stop") or []
    if isinstance(stops, str):
        stops = [stops]
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest("stop must be a string or a list of strings")
    if chat:
        want = body.get("logprobs")
        top = _number(body, "top_logprobs", 0, int, low=0, high=MAX_TOP_LOGPROBS)
        if top and not want:
            raise BadRequest("top_logprobs needs logprobs=true")
        logprobs = top if want else None
    else:
        lp = body.get("logprobs")
        logprobs = None if lp is None else _number(body, "logprobs", 0, int, 0, MAX_TOP_LOGPROBS)
    options = body.get("stream_options") or {}
    metadata = body.get("metadata") or {}
    category = metadata.get("category") if isinstance(metadata, dict) else None
    category = category if category is not None else body.get("category")
    return Parsed(
        chat=chat,
        prompt_ids=prompt_ids,
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=Sampling(temperature, None if top_p >= 1.0 else top_p, None, seed),
        stops=stops,
        logprobs=logprobs,
        stream=bool(body.get("stream")),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        category=None if category is None else str(category),
        seed=seed,
    )


# ----------------------------------------------------------------------------- one request


class Run:
    """One request in flight: its job, its queue of worker events, its text and timings."""

    def __init__(self, app_state, parsed: Parsed):
        self.s, self.p = app_state, parsed
        self.id = ("chatcmpl-" if parsed.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.start = time.perf_counter()
        self.ttft: float | None = None
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def deliver(event, loop=loop, q=self.queue):
            try:
                loop.call_soon_threadsafe(q.put_nowait, event)
            except RuntimeError:  # the event loop is closed: the server is going away
                pass

        k = parsed.logprobs
        if app_state.traffic is not None and app_state.config.log_top_logprobs > 0:
            k = max(k or 0, app_state.config.log_top_logprobs)
        self.job = Job(parsed.prompt_ids, parsed.max_tokens, parsed.sampling, k, deliver)
        self.text = TextTracker(app_state.tokenizer, parsed.stops)
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.stats: dict | None = None
        self.finished = False

    def submit(self):
        self.s.worker.submit(self.job)
        self.s.metrics.running.inc()

    def cancel(self):
        if not self.finished:
            self.finished = True
            self.s.worker.cancel(self.job)
            self.s.metrics.running.dec()

    async def next_delta(self) -> tuple[str, list]:
        """Wait for the worker's next event: (new text, new logprob entries)."""
        event = await self.queue.get()
        if "error" in event:
            self.finished = True
            self.s.metrics.running.dec()
            raise RuntimeError(event["error"])
        if event["tokens"] and self.ttft is None:
            self.ttft = time.perf_counter() - self.start
        before = self.text.n_tokens
        delta = self.text.push(event["tokens"], final=event["finished"])
        new_lp = event["logprobs"] or []
        if self.text.stopped:
            keep = self.text.n_tokens - before
            new_lp = new_lp[: max(keep, 0)]
            self.finish_reason = "stop"
        self.logprobs += new_lp
        self.stats = event["stats"]
        if event["finished"] or self.text.stopped:
            if self.finish_reason is None:
                self.finish_reason = event["finish_reason"]
            if not event["finished"]:  # a stop string: free the row now
                self.s.worker.cancel(self.job)
            self.finished = True
            self.s.metrics.running.dec()
        return delta, new_lp

    @property
    def completion_ids(self) -> list[int]:
        return self.text.ids[: self.text.n_tokens]

    def usage(self) -> dict:
        n_out = len(self.completion_ids)
        n_in = len(self.p.prompt_ids)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    def extras(self) -> dict:
        return {
            "metrics": {"speculative_decoding": self.stats},
            "draft_version": self.job.version,
        }

    # ------------------------------------------------------------------ logprobs formats
    def _tok(self, t: int) -> str:
        return self.s.tokenizer.decode([t])

    def logprobs_json(self, entries: list, ids: list[int], offset: int = 0):
        if self.p.logprobs is None:
            return None
        k = self.p.logprobs
        if self.p.chat:
            content = []
            for t, (lp, top) in zip(ids, entries, strict=False):
                s = self._tok(t)
                content.append(
                    {
                        "token": s,
                        "logprob": lp,
                        "bytes": list(s.encode()),
                        "top_logprobs": [
                            {"token": (a := self._tok(i)), "logprob": v, "bytes": list(a.encode())}
                            for i, v in top[:k]
                        ],
                    }
                )
            return {"content": content}
        tokens = [self._tok(t) for t in ids[: len(entries)]]
        offsets, pos = [], offset
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for lp, _ in entries],
            "top_logprobs": [{self._tok(i): v for i, v in top[:k]} for _, top in entries]
            if k
            else None,
            "text_offset": offsets,
        }

    # ------------------------------------------------------------------ the record
    async def log(self):
        s = self.s
        latency = time.perf_counter() - self.start
        stats = self.stats or {}
        s.metrics.finished(
            stats,
            len(self.p.prompt_ids),
            len(self.completion_ids),
            self.finish_reason,
            latency,
            self.ttft,
        )
        if s.traffic is None:
            return
        k = s.config.log_top_logprobs
        top = None
        if k > 0:
            top = [[[i, v] for i, v in alts[:k]] for _, alts in self.logprobs]
        sp = self.p.sampling
        record = {
            "schema_version": SCHEMA_VERSION,
            "id": self.id,
            "time": time.time(),
            "endpoint": "chat.completions" if self.p.chat else "completions",
            "target": {"name": s.config.target_name, "identity": s.config.target_identity},
            "draft_version": self.job.version,
            "sampling": {
                "temperature": sp.temperature,
                "top_p": 1.0 if sp.top_p is None else sp.top_p,
                "max_tokens": self.p.max_tokens,
                "seed": self.p.seed,
                "stop": self.p.stops,
            },
            "prompt": self.p.prompt,
            "prompt_token_ids": list(self.p.prompt_ids),
            "completion_token_ids": self.completion_ids,
            "completion_text": self.text.text,
            "finish_reason": self.finish_reason,
            "speculative": stats,
            "category": self.p.category,
            "top_logprobs": top,
            "latency_s": latency,
            "ttft_s": self.ttft,
        }
        try:
            await asyncio.to_thread(s.traffic.append, record)
        except Exception:  # noqa: BLE001 - a full disk must not fail the request
            log.exception("traffic record %s not written", self.id)


class AppState:
    def __init__(
        self, tokenizer, worker: EngineWorker, config: ServerConfig, traffic: TrafficLog | None
    ):
        self.tokenizer, self.worker, self.config, self.traffic = tokenizer, worker, config, traffic
        self.metrics = Metrics()


def _error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status == 400 else "server_error"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status
    )


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def build_app(state: AppState) -> FastAPI:
    app = FastAPI(title="specdistill serve")
    app.state.serve = state

    @app.get("/health")
    async def health():
        return {"status": "ok", "draft_version": state.worker.version}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": state.config.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "specdistill",
                    "draft_version": state.worker.version,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.expose(state.worker.version), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    async def handle(request: Request, chat: bool):
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not valid JSON")
        try:
            parsed = parse(body, state.tokenizer, state.config, chat)
        except BadRequest as e:
            return _error(400, str(e))
        run = Run(state, parsed)
        run.submit()
        if parsed.stream:
            return StreamingResponse(stream(run), media_type="text/event-stream")
        task = asyncio.ensure_future(collect(run))
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                break
            if await request.is_disconnected():  # the client is gone: free its row
                task.cancel()
                run.cancel()
                return Response(status_code=499)
        try:
            return JSONResponse(task.result())
        except RuntimeError as e:
            return _error(500, str(e))

    async def stream(run: Run):
        p = run.p
        obj = "chat.completion.chunk" if p.chat else "text_completion"
        base = {
            "id": run.id,
            "object": obj,
            "created": run.created,
            "model": state.config.model_name,
        }
        first = True
        sent_ids = 0
        offset = 0
        try:
            while not run.finished:
                try:
                    delta, lps = await run.next_delta()
                except RuntimeError as e:
                    yield _sse({"error": {"message": str(e), "type": "server_error"}})
                    return
                ids = run.completion_ids[sent_ids : sent_ids + len(lps)] if lps else []
                sent_ids += len(lps)
                if delta or (lps and p.logprobs is not None) or first or run.finished:
                    lp_json = run.logprobs_json(lps, ids, offset) if lps else None
                    offset += len(delta)
                    choice = {
                        "index": 0,
                        "logprobs": lp_json,
                        "finish_reason": run.finish_reason if run.finished else None,
                    }
                    if p.chat:
                        choice["delta"] = (
                            {"role": "assistant", "content": delta} if first else {"content": delta}
                        )
                    else:
                        choice["text"] = delta
                    chunk = {**base, "choices": [choice]}
                    if run.finished:
                        chunk.update(run.extras())
                    if p.include_usage:
                        chunk["usage"] = None
                    first = False
                    yield _sse(chunk)
            await run.log()
            if p.include_usage:
                yield _sse({**base, "choices": [], "usage": run.usage(), **run.extras()})
            yield b"data: [DONE]\n\n"
        finally:
            run.cancel()  # a client gone mid-stream frees its row (no-op when finished)

    return app


async def collect(run: Run) -> dict:
    """Read a run to its end; the non-streaming response body."""
    while not run.finished:
        await run.next_delta()
    await run.log()
    p = run.p
    ids = run.completion_ids
    choice = {
        "index": 0,
        "finish_reason": run.finish_reason,
        "logprobs": run.logprobs_json(run.logprobs, ids),
    }
    if p.chat:
        choice["message"] = {"role": "assistant", "content": run.text.text}
        obj = "chat.completion"
    else:
        choice["text"] = run.text.text
        obj = "text_completion"
    return {
        "id": run.id,
        "object": obj,
        "created": run.created,
        "model": run.s.config.model_name,
        "choices": [choice],
        "usage": run.usage(),
        **run.extras(),
    }
