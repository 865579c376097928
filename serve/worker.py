"""The engine worker: one thread owns the models and decodes every request.

HTTP handlers `submit` jobs and read their events from an asyncio queue; the worker admits
new jobs into the running batch between rounds (eval.engine.Engine), runs one round at a
time and hands each job its new tokens through the event loop (`loop.call_soon_threadsafe`),
so a slow client only grows its own queue and never holds up the decoding. A cancelled job
(its client went away) leaves the batch before the next round.

Hot swap: a new draft version (serve/drafts.py) gets an engine of its own; new jobs go to
it while the previous engine finishes the jobs it has (then is dropped). A job is decoded
by one draft version from start to end, and names it.

Draft length: the server's `GammaSetting` (eval/length_policy.py; --gamma and --max-gamma)
gives each engine its own policy for its draft version: a fixed number of drafts per round,
or "auto" (also the default for a draft that carries an acceptance head). Under "auto" each
engine has its own `AutoGamma`, whose cost model is kept per batch size: the busier the
server, the dearer a drafted token against the verification it saves, so rows draft less,
and a round where no row's drafting can pay is a plain target step. Its costs are measured
at start-up (and for each new version) at the server's row count and at the powers of two
below it.
"""

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specdistill.eval.engine import Engine, Sampling, SpecStats
from specdistill.eval.length_policy import GammaSetting
from specdistill.threads import ThreadPolicy

log = logging.getLogger("specdistill.serve")


@dataclass(frozen=True)
class LengthTally:
    """A finished request's draft-length sums for /metrics: Σ predicted acceptance over the
    drafts verification reached, how many it reached, and how many of those were accepted."""

    predicted_sum: float
    reached: int
    reached_accepted: int

    @classmethod
    def of(cls, stats: SpecStats) -> "LengthTally":
        return cls(stats.predicted_sum, stats.reached, stats.reached_accepted)


def request_stats(stats: SpecStats) -> dict:
    """`metrics.speculative_decoding`: vLLM's statistics and the draft-length ones."""
    return {**stats.as_dict(), **stats.length_dict()}


@dataclass(frozen=True)
class Progress:
    """A job's new tokens after a decoding round (the last one has `finished` set)."""

    tokens: list[int]
    logprobs: list | None  # per new token (logprob, [(token id, logprob), ...]); None: not asked
    finished: bool
    finish_reason: str | None  # "stop" or "length" once finished
    stats: dict  # the request's speculative statistics so far (`metrics.speculative_decoding`)
    tally: LengthTally | None = None  # set once finished


@dataclass(frozen=True)
class Failed:
    """The job ended without a completion: the engine refused it, a round failed, or the
    server is shutting down."""

    error: str


Event = Progress | Failed


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    logprobs: int | None  # top-k alternatives per token (0: only the token), None: none
    deliver: Callable[[Event], None]  # thread-safe
    version: str | None = None  # set when the worker assigns it an engine
    submitted: float = field(default_factory=time.perf_counter)
    rid: int | None = None
    engine: object = None
    done: bool = False


class EngineWorker(threading.Thread):
    """Decodes jobs with the current draft version; `swap` installs a new one between rounds.
    `length` gives each version's engine its draft-length policy."""

    def __init__(
        self,
        target,
        draft,
        version,
        *,
        length: GammaSetting,
        capacity: int,
        eos_token_id,
        vocab_size,
        threads: ThreadPolicy | None = None,
    ):
        super().__init__(name="specdistill-engine", daemon=True)
        self.threads = threads  # re-checked between rounds (specdistill/threads.py)
        self.target = target
        self.length, self.capacity = length, capacity
        self.eos_token_id, self.vocab_size = eos_token_id, vocab_size
        self.inbox: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.current = self._engine(draft, version)
        self.draining: list[Engine] = []  # previous versions finishing their jobs
        self.jobs: dict[tuple[int, int], Job] = {}  # (id(engine), rid) -> job
        self.rounds = 0

    def _engine(self, draft, version):
        engine = Engine(
            self.target,
            draft,
            gamma=self.length.policy(draft, self.capacity),
            capacity=self.capacity,
            eos_token_id=self.eos_token_id,
            vocab_size=self.vocab_size,
        )
        engine.version = version
        return engine

    @property
    def version(self) -> str | None:
        return self.current.version

    # ------------------------------------------------------------------ from other threads
    def submit(self, job: Job) -> None:
        self.inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        self.inbox.put(("cancel", job))

    def swap(self, draft, version: str | None) -> None:
        """Serve new jobs with `draft` from the next round on (loaded by the caller)."""
        self.inbox.put(("swap", (draft, version)))

    def stop(self) -> None:
        self.stopping.set()
        self.inbox.put(("stop", None))

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        while not self.stopping.is_set():
            busy = any(e.busy for e in [self.current, *self.draining])
            try:
                command = self.inbox.get(timeout=None if not busy else 0)
                while True:
                    self._handle(*command)
                    command = self.inbox.get_nowait()
            except queue.Empty:
                pass
            if self.stopping.is_set():
                break
            for engine in [self.current, *self.draining]:
                if engine.busy:
                    self._step(engine)
            self.draining = [e for e in self.draining if e.busy]
            if self.threads is not None:
                self.threads.recheck(say=log.info)
        for job in list(self.jobs.values()):
            job.deliver(Failed("server shutting down"))

    def _handle(self, kind: str, payload) -> None:
        if kind == "submit":
            job = payload
            engine = self.current
            try:
                job.rid = engine.add(
                    job.prompt_ids,
                    max_new_tokens=job.max_tokens,
                    sampling=job.sampling,
                    logprobs=job.logprobs,
                )
            except ValueError as e:
                job.deliver(Failed(str(e)))
                return
            job.engine, job.version = engine, engine.version
            self.jobs[id(engine), job.rid] = job
        elif kind == "cancel":
            job = payload
            if job.engine is not None and self.jobs.pop((id(job.engine), job.rid), None):
                job.engine.cancel(job.rid)
        elif kind == "swap":
            draft, version = payload
            try:
                new = self._engine(draft, version)
            except Exception as e:  # noqa: BLE001 - a bad version must not stop the server
                log.error(
                    "draft version %s: engine failed to start (%s); keeping %s",
                    version,
                    e,
                    self.version,
                )
                return
            if self.current.busy:
                self.draining.append(self.current)
            self.current = new
            log.info("draft version %s now serves new requests", version)

    def _step(self, engine: Engine) -> None:
        try:
            updates = engine.step()
        except Exception as e:  # noqa: BLE001 - fail this engine's jobs, keep serving
            log.exception("decoding round failed")
            for key in [k for k in self.jobs if k[0] == id(engine)]:
                self.jobs.pop(key).deliver(Failed(f"decoding failed: {e}"))
            fresh = self._engine(engine.draft, engine.version)
            if engine is self.current:
                self.current = fresh
            else:
                self.draining.remove(engine)
            return
        self.rounds += 1
        for u in updates:
            job = self.jobs.get((id(engine), u.request))
            if job is None:
                continue
            stats = engine.stats(u.request)
            event = Progress(
                u.tokens,
                u.logprobs,
                u.finished,
                u.finish_reason,
                request_stats(stats),
                LengthTally.of(stats) if u.finished else None,
            )
            if u.finished:
                del self.jobs[id(engine), u.request]
            job.deliver(event)
