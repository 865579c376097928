"""The OpenAI-compatible HTTP side: FastAPI routes, SSE streaming, /metrics, traffic records.

Handlers parse a request, submit a `Job` to the engine worker (serve/worker.py) and read
its events from their own asyncio queue: decoding never runs on the event loop, and a slow
or gone client only concerns its own queue (a gone one is cancelled, freeing its row).

Responses carry OpenAI's fields plus `metrics.speculative_decoding` (vLLM's per-request
shape) and `draft_version`. Log-probabilities are the target's, from its raw logits
(temperature 1, no top-p), of each generated token, as vLLM reports them by default.
"""

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from specdistill.formats.traffic import SCHEMA_VERSION, SamplingRecord, Target, TrafficRecord
from specdistill.serve import errors
from specdistill.serve.auth import ApiKeys, AuthMiddleware
from specdistill.serve.errors import APIError, error_body, error_response
from specdistill.serve.intake import BodyReader
from specdistill.serve.metrics import Metrics
from specdistill.serve.options import Limits
from specdistill.serve.responses import (
    Choice,
    Completion,
    Delta,
    Message,
    ModelCard,
    ModelList,
    SpecMetrics,
    Usage,
    body,
)
from specdistill.serve.schema import Parsed, parse, validate_body
from specdistill.serve.text import TextTracker
from specdistill.serve.traffic import TrafficLog
from specdistill.serve.worker import EngineWorker, Failed, Job, LengthTally

log = logging.getLogger("specdistill.serve")


@dataclass(frozen=True)
class ServerConfig:
    """What the routes read of the server's options (serve/options.py), resolved."""

    model_name: str  # what /v1/models lists and responses name; the only `model` accepted
    target_name: str
    target_identity: str
    limits: Limits
    log_top_logprobs: int  # top-k target logprobs per token in the traffic log
    max_num_seqs: int  # rows decoded together
    max_queue: int  # admitted requests beyond the rows (parsing or waiting for a row)
    max_gamma: int  # the top bucket of the drafted-length histogram in /metrics
    body_timeout_s: float  # seconds a request's body may take to arrive (408 past them)


# ----------------------------------------------------------------------------- one request


class Run:
    """One request in flight: its job, its queue of worker events, its text and timings."""

    def __init__(self, app_state, parsed: Parsed, client: str | None):
        """Takes over one admitted slot of `app_state` (released when the run ends)."""
        self.s, self.p, self.client = app_state, parsed, client
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
        self.tally: LengthTally | None = None
        self.finished = False

    def submit(self):
        self.s.worker.submit(self.job)
        self.s.metrics.running.inc()

    def _end(self):
        if not self.finished:
            self.finished = True
            self.s.metrics.running.dec()
            self.s.release()

    def cancel(self):
        """Free the row (a gone client, a drain); a no-op once the run has ended."""
        if not self.finished:
            self.s.worker.cancel(self.job)
            self._end()

    async def next_delta(self) -> tuple[str, list]:
        """Wait for the worker's next event: (new text, new logprob entries)."""
        event = await self.queue.get()
        if isinstance(event, Failed):
            self._end()
            raise RuntimeError(event.error)
        if event.tokens and self.ttft is None:
            self.ttft = time.perf_counter() - self.start
        before = self.text.n_tokens
        delta = self.text.push(event.tokens, final=event.finished)
        new_lp = event.logprobs or []
        if self.text.stopped:
            keep = self.text.n_tokens - before
            new_lp = new_lp[: max(keep, 0)]
            self.finish_reason = "stop"
        self.logprobs += new_lp
        self.stats = event.stats
        self.tally = event.tally or self.tally
        if event.finished or self.text.stopped:
            if self.finish_reason is None:
                self.finish_reason = event.finish_reason
            if not event.finished:  # a stop string: free the row now
                self.s.worker.cancel(self.job)
            self._end()
        return delta, new_lp

    @property
    def completion_ids(self) -> list[int]:
        return self.text.ids[: self.text.n_tokens]

    def usage(self) -> Usage:
        n_out = len(self.completion_ids)
        n_in = len(self.p.prompt_ids)
        return Usage(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out)

    def extras(self) -> dict:
        """The fields of a last chunk and a whole response beyond OpenAI's."""
        return {
            "metrics": SpecMetrics(speculative_decoding=self.stats),
            "draft_version": self.job.version,
        }

    def body(self, obj: str, choices: list[Choice], **fields) -> Completion:
        """A response body or chunk of this run."""
        model = self.s.config.model_name
        return Completion(
            id=self.id, object=obj, created=self.created, model=model, choices=choices, **fields
        )

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
            self.tally,
        )
        if s.traffic is None:
            return
        k = s.config.log_top_logprobs
        top = None
        if k > 0:
            top = [[[i, v] for i, v in alts[:k]] for _, alts in self.logprobs]
        sp = self.p.sampling
        try:
            record = TrafficRecord(
                schema_version=SCHEMA_VERSION,
                id=self.id,
                time=time.time(),
                endpoint="chat.completions" if self.p.chat else "completions",
                target=Target(name=s.config.target_name, identity=s.config.target_identity),
                draft_version=self.job.version,
                sampling=SamplingRecord(
                    temperature=sp.temperature,
                    top_p=1.0 if sp.top_p is None else sp.top_p,
                    max_tokens=self.p.max_tokens,
                    seed=self.p.seed,
                    stop=self.p.stops,
                ),
                prompt=self.p.prompt,
                prompt_token_ids=list(self.p.prompt_ids),
                completion_token_ids=self.completion_ids,
                completion_text=self.text.text,
                finish_reason=self.finish_reason,
                speculative=stats,
                category=self.p.category,
                top_logprobs=top,
                latency_s=latency,
                ttft_s=self.ttft,
                client=self.client,
            )
            await asyncio.to_thread(s.traffic.append, record)
        except Exception:  # noqa: BLE001 - a full disk must not fail the request
            log.exception("traffic record %s not written", self.id)


class AppState:
    """What the routes share: models, worker, config, traffic log, metrics, admissions.

    `in_flight` counts admitted requests (being parsed, waiting for a row, or decoding; a
    request is admitted once its body is read, serve/intake.py);
    at `max_num_seqs + max_queue` a new one is answered 503 with Retry-After. It is read and
    written on the event loop only.
    """

    def __init__(
        self,
        tokenizer,
        worker: EngineWorker,
        config: ServerConfig,
        traffic: TrafficLog | None,
        keys: ApiKeys | None = None,
    ):
        self.tokenizer, self.worker, self.config, self.traffic = tokenizer, worker, config, traffic
        self.keys = keys or ApiKeys([])
        self.metrics = Metrics(config.max_gamma)
        self.watcher = None  # the --drafts DraftWatcher (serve/drafts.py): its state in /health
        self.in_flight = 0
        self.capacity = config.max_num_seqs + config.max_queue
        # bodies are read before admission; together they hold what admitted requests may
        self.bodies = BodyReader(
            config.limits.max_body_bytes,
            config.body_timeout_s,
            self.capacity * config.limits.max_body_bytes,
        )
        # one thread parses and tokenises, off the event loop (/health answers meanwhile)
        self.parser = ThreadPoolExecutor(1, thread_name_prefix="specdistill-tokenize")

    def admit(self) -> None:
        if self.in_flight >= self.capacity:
            raise APIError(
                503,
                f"the server is at capacity ({self.config.max_num_seqs} running, "
                f"{self.config.max_queue} queued); retry later",
                headers={"Retry-After": "1"},
            )
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1


def _sse(obj: BaseModel) -> bytes:
    return b"data: " + obj.model_dump_json().encode() + b"\n\n"


def build_app(state: AppState) -> FastAPI:
    """The FastAPI app on `state`: errors in OpenAI's shape, API keys checked, the status
    routes and the completion routes."""
    app = FastAPI(title="specdistill serve")
    app.state.serve = state
    errors.install(app)
    app.add_middleware(AuthMiddleware, keys=state.keys)
    add_status_routes(app, state)
    add_completion_routes(app, state)
    return app


def add_status_routes(app: FastAPI, state: AppState) -> None:
    """GET /health, /v1/models and /metrics."""

    @app.get("/health")
    async def health():
        drafts = state.watcher.health() if state.watcher is not None else None
        status = "degraded" if drafts and not drafts["ok"] else "ok"
        return {"status": status, "draft_version": state.worker.version, "drafts": drafts}

    @app.get("/v1/models")
    async def models():
        card = ModelCard(id=state.config.model_name, draft_version=state.worker.version)
        return body(ModelList(data=[card]))

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.expose(state.worker.version), media_type=CONTENT_TYPE_LATEST)


def add_completion_routes(app: FastAPI, state: AppState) -> None:
    """POST /v1/completions and /v1/chat/completions."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(state, request, chat=True)


async def handle(state: AppState, request: Request, chat: bool):
    """One completion request: its body read, an admission slot taken, the run started and
    streamed or collected; its row freed however it ends."""
    raw = await state.bodies.read(request)  # no slot is held while a body arrives
    state.admit()
    run = None
    try:
        run = await start(state, request, chat, raw)
    finally:
        del raw
        if run is None:  # refused: the slot goes back
            state.release()
    if run.p.stream:
        return StreamingResponse(stream(run), media_type="text/event-stream")
    task = asyncio.ensure_future(collect(run))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                break
            if await request.is_disconnected():  # the client is gone: free its row
                return Response(status_code=499)
        try:
            return body(task.result())
        except RuntimeError as e:
            return error_response(500, str(e))
    finally:  # gone, failed, or cancelled by a drain: the row is freed
        if not task.done():
            task.cancel()
        run.cancel()


async def start(state: AppState, request: Request, chat: bool, raw: bytes) -> Run:
    """Validate and tokenise the request's body within the limits; submit it."""
    limits = state.config.limits
    loop = asyncio.get_running_loop()  # parsing and tokenising: off the event loop
    req = await loop.run_in_executor(state.parser, validate_body, raw, chat, limits)
    del raw
    if req.model is not None and req.model != state.config.model_name:
        raise APIError(404, f"The model `{req.model}` does not exist.", param="model")
    parsed = await loop.run_in_executor(state.parser, parse, req, state.tokenizer, limits)
    run = Run(state, parsed, getattr(request.state, "client", None))
    run.submit()
    return run


async def stream(run: Run):
    """A run's server-sent events: a chunk per new text (or logprobs), the last one with
    the run's statistics, then usage if asked and [DONE]."""
    p = run.p
    obj = "chat.completion.chunk" if p.chat else "text_completion"
    first = True
    sent_ids = 0
    offset = 0
    try:
        while not run.finished:
            try:
                delta, lps = await run.next_delta()
            except RuntimeError as e:
                yield _sse(error_body(500, str(e)))
                return
            ids = run.completion_ids[sent_ids : sent_ids + len(lps)] if lps else []
            sent_ids += len(lps)
            if delta or (lps and p.logprobs is not None) or first or run.finished:
                lp_json = run.logprobs_json(lps, ids, offset) if lps else None
                offset += len(delta)
                finish = run.finish_reason if run.finished else None
                if p.chat:
                    role = {"role": "assistant"} if first else {}
                    text = {"delta": Delta(content=delta, **role)}
                else:
                    text = {"text": delta}
                choice = Choice(logprobs=lp_json, finish_reason=finish, **text)
                fields = run.extras() if run.finished else {}
                if p.include_usage:
                    fields["usage"] = None
                first = False
                yield _sse(run.body(obj, [choice], **fields))
        await run.log()
        if p.include_usage:
            yield _sse(run.body(obj, [], usage=run.usage(), **run.extras()))
        yield b"data: [DONE]\n\n"
    finally:
        run.cancel()  # a client gone mid-stream frees its row (no-op when finished)


async def collect(run: Run) -> Completion:
    """Read a run to its end; the non-streaming response body."""
    while not run.finished:
        await run.next_delta()
    await run.log()
    logprobs = run.logprobs_json(run.logprobs, run.completion_ids)
    if run.p.chat:
        text, obj = {"message": Message(content=run.text.text)}, "chat.completion"
    else:
        text, obj = {"text": run.text.text}, "text_completion"
    choice = Choice(finish_reason=run.finish_reason, logprobs=logprobs, **text)
    return run.body(obj, [choice], usage=run.usage(), **run.extras())
