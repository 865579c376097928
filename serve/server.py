"""The server of `specdistill serve` (serve/serve_cli.py): models, engine worker, draft
watcher, traffic log and the FastAPI app, wired from one `ServeOptions` (serve/options.py).

Start-up, in order: the options already checked, the traffic directory and the device are
(nothing has loaded yet); the tokenizer and the target (with its adapter, unmerged); the
limits each request is checked against, from the options and the target's context; the
first draft (--draft, or --drafts ROOT's current version, watched from then on); the engine
worker with the draft-length setting (`GammaSetting`, eval/length_policy.py), which builds
each draft version's own policy; the traffic log; the app (serve/app.py); one 2-token
generation that warms the engine before anything answers. uvicorn runs it
(serve/uvicorn_server.py `HttpServer`).
"""

import logging
import time

from specdistill.drafts.checked_load import load_checked
from specdistill.eval.cli_args import resolve_device
from specdistill.eval.length_policy import GammaSetting
from specdistill.models.identity import model_identity
from specdistill.models.target_spec import TargetSpec, load_target_and_tokenizer
from specdistill.serve.app import AppState, ServerConfig, build_app
from specdistill.serve.auth import ApiKeys, parse_keys
from specdistill.serve.drafts import DraftWatcher, WatchMetrics
from specdistill.serve.flags import check_traffic_dir
from specdistill.serve.options import Limits, ServeOptions
from specdistill.serve.traffic import TrafficLog
from specdistill.serve.uvicorn_server import HttpServer
from specdistill.serve.worker import EngineWorker
from specdistill.threads import ThreadPolicy

log = logging.getLogger("specdistill.serve")


class Server:
    """Models, engine worker, draft watcher, traffic log and the FastAPI app, in one object,
    from `options`; `threads`: the CPU thread policy the engine worker re-checks between
    rounds (serve/serve_cli.py `set_threads`; None: torch's own).

    `start()` runs uvicorn on a background thread (tests, benchmarks) and returns the base
    URL; `serve()` runs it in the foreground (the CLI); `stop()` ends everything.
    """

    def __init__(self, options: ServeOptions, *, threads: ThreadPolicy | None = None):
        check_traffic_dir(options.traffic)
        device = resolve_device(options.device)
        self.options = options
        self.keys = ApiKeys(parse_keys(options.api_key))
        self.target, self.tokenizer, identity = self._load_target(device)
        self.limits = self._limits()
        self.watcher = None
        draft, version = self._first_draft()
        self.worker = EngineWorker(
            self.target,
            draft,
            version,
            length=GammaSetting(options.gamma, options.max_gamma),
            capacity=options.max_num_seqs,
            eos_token_id=self.tokenizer.eos_token_id,
            vocab_size=len(self.tokenizer),
            threads=threads,
        )
        self.traffic = TrafficLog(options.traffic, options.shard_bytes) if options.traffic else None
        self.state = self._app_state(identity)
        self.app = build_app(self.state)
        self.http = HttpServer(self.app, self.keys, options.insecure, options.drain_s)
        self.warm_up_s = warm_up(self.worker.current, self.tokenizer.eos_token_id)

    # ------------------------------------------------------------------ start-up steps
    def _load_target(self, device: str):
        """(the target on `device`, its tokenizer, its identity), loaded from the options
        (models/target_spec.py). A peft adapter stays unmerged; the identity the traffic records
        carry covers its files, so the online job refuses records of another adapter or of the
        bare base."""
        o = self.options
        target, tokenizer = load_target_and_tokenizer(TargetSpec.from_args(o, device=device))
        target = target.eval()
        return target, tokenizer, model_identity(o.target, target, o.target_adapter)

    def _limits(self) -> Limits:
        """The request limits, --max-model-len defaulting to the target's context."""
        context = getattr(self.target.config, "max_position_embeddings", None)
        asked = self.options.max_model_len
        if asked is not None and context and asked > context:
            log.warning(
                "--max-model-len %d is beyond the target's context (%d positions): outputs "
                "past it depend on how the model extrapolates",
                asked,
                context,
            )
        return self.options.limits(context)

    def _first_draft(self) -> tuple[object, str | None]:
        """(draft, version) to serve first (None: the target alone). --drafts ROOT: its
        current version, and the watcher (`self.watcher`) that installs the next ones."""
        o = self.options
        if o.drafts is not None:
            self.watcher = DraftWatcher(
                o.drafts, self.target, self.tokenizer, self._install, poll_s=o.poll_s, dtype=o.dtype
            )
            found = self.watcher.poll()
            if found is None:
                log.warning("%s: no loadable draft version yet; serving the target alone", o.drafts)
            return found or (None, None)
        if o.draft is not None and o.draft != "none":
            return load_checked(o.draft, self.target, self.tokenizer, dtype=o.dtype), o.draft
        return None, None

    def _app_state(self, identity: str):
        """What the routes share (serve/app.py `AppState`), the watch's failed polls in
        /health and /metrics."""
        o = self.options
        config = ServerConfig(
            model_name=o.model_name,
            target_name=o.target_name,
            target_identity=identity,
            limits=self.limits,
            log_top_logprobs=o.log_top_logprobs if o.traffic else 0,
            max_num_seqs=o.max_num_seqs,
            max_queue=o.max_queue,
            max_gamma=self.worker.length.most_drafts,
            body_timeout_s=o.body_timeout_s,
        )
        state = AppState(self.tokenizer, self.worker, config, self.traffic, self.keys)
        if self.watcher is not None:
            state.watcher = self.watcher
            state.metrics.registry.register(WatchMetrics(self.watcher))
        return state

    def _install(self, draft, version: str) -> None:
        self.worker.swap(draft, version)

    def _begin(self) -> None:
        self.worker.start()
        if self.watcher is not None:
            self.watcher.start()

    # ------------------------------------------------------------------ running
    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on a background thread; the base URL (port 0: a free port)."""
        config, sock = self.http.listen(host, port)
        self._begin()
        return self.http.start(config, sock)

    def serve(self, host: str = "127.0.0.1", port: int = 8000) -> None:
        """Serve in the foreground until SIGTERM or SIGINT, then drain: stop accepting, let
        running requests finish for at most --drain-s seconds, cancel the rest, return."""
        config = self.http.config(host, "info", port=port)
        self._begin()
        try:
            self.http.run(config)
        finally:
            self.stop()

    def stop(self) -> None:
        self.http.stop()
        if self.watcher is not None:
            self.watcher.stop()
        self.worker.stop()
        if self.worker.is_alive():
            self.worker.join(timeout=10)
        self.state.parser.shutdown(wait=False, cancel_futures=True)
        if self.traffic is not None:
            self.traffic.close()


def warm_up(engine, token_id: int | None) -> float:
    """One tiny generation through `engine` before the server answers anything (/health
    included); its seconds. On the calling (main) thread, before the engine thread starts:
    an engine first run on the engine thread stayed slow on several CPU threads
    (benchmarks/RESULTS.md), besides the lazy initialisation no request should pay for."""
    start = time.perf_counter()
    engine.add([token_id or 0], max_new_tokens=2)
    while engine.busy:
        engine.step()
    log.info("warmed up with one 2-token generation in %.1fs", time.perf_counter() - start)
    return time.perf_counter() - start
