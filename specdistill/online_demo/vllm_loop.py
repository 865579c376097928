"""The online loop behind a live vLLM (`specdistill online demo --engine vllm`): what replaces
this project's server when vLLM's OpenAI server serves the target and the draft.

    clients -> LoggingProxy (serve/proxy.py) -> vLLM server on ROOT/current's export
                  |  proxy-log.jsonl                 |  GET /metrics, every --scrape-s
                  v                                  v
           convert-traffic (every 2 s)        Scraper: served α per window -> served.jsonl;
                  |  traffic/                   a drop asks the job for a refresh
                  v
           the online job (follow) -> ROOT/vNNNNNN, ROOT/current
                  |
           Deployment: a promoted version is exported for vLLM, a second server starts on it
           beside the first, the proxy switches to it, the first finishes what it holds and
           stops: no client request fails across the redeploy

Requests are greedy (temperature 0) with the top `--top-logprobs` log-probabilities and token
ids returned: vLLM's CPU build accepts far too little at temperature > 0 (RESULTS.md, "vLLM
decodes the drafts"), so served acceptance there would measure vLLM, not the draft.
"""

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from specdistill.eval.served_metrics import MetricsError, ServedCounters, ServedWindow, scrape
from specdistill.eval.vllm_compare import export_draft, speculation_of
from specdistill.eval.vllm_engine import VllmError, VllmSettings
from specdistill.formats.published import read_current, version_draft_dir
from specdistill.models import hub
from specdistill.models.identity import model_identity
from specdistill.online_demo.training import context_cut
from specdistill.serve.convert import convert
from specdistill.serve.proxy import LoggingProxy
from specdistill.serve.vllm_server import VllmServer, VllmServerSettings

SERVED_NAME = "served-target"  # the name clients ask vLLM for


def vllm_body(args, n: int, category: str, prompt: list[int]) -> dict:
    """Request n to vLLM: greedy, with the top log-probabilities and the token ids the
    online job learns from, and the category the job's hold-out balances."""
    return {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "logprobs": args.top_logprobs,
        "return_token_ids": True,
        "metadata": {"category": category},
    }


def _log(path: Path, entry: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")


class Deployment:
    """The vLLM server behind the proxy, on the version it was started from; `export(version)`
    gives (the exported draft directory, vLLM's speculative keys)."""

    def __init__(
        self,
        settings: VllmServerSettings,
        export: Callable[[str], tuple[str, Mapping]],
        out: Path,
        drain_s: float = 300.0,
    ):
        self.settings, self.export, self.out, self.drain_s = settings, export, out, drain_s
        self.proxy: LoggingProxy | None = None
        self.server: VllmServer | None = None
        self.version: str | None = None
        self.events: list[dict] = []

    @property
    def upstream(self) -> str:
        return self.proxy.upstream

    def _server(self, version: str) -> VllmServer:
        draft, speculation = self.export(version)
        server = VllmServer(self.settings, draft, speculation)
        server.start(self.out / f"vllm-{version}.log")
        return server

    def start(self, version: str) -> str:
        """The first server on `version` and the proxy in front of it; the proxy's URL."""
        t0 = time.time()
        self.server, self.version = self._server(version), version
        self.proxy = LoggingProxy(self.server.url, self.out / "proxy-log.jsonl")
        url = self.proxy.start()
        self._event(
            {
                "event": "started",
                "version": version,
                "url": self.server.url,
                "start_s": time.time() - t0,
            }
        )
        return url

    def deploy(self, version: str, read: Callable[[str], object] | None = None) -> dict:
        """Serve `version`: its server started beside the current one, the proxy switched, the
        old server drained and stopped; `read(url)` (the scraper's) is called on the new
        server just before the switch and on the old one just before it stops."""
        t0 = time.time()
        new = self._server(version)
        started = time.time()
        if read is not None:
            read(new.url)
        old, old_url = self.server, self.proxy.switch(new.url)
        self.server, self.version = new, version
        drained = self.proxy.drain(old_url, self.drain_s)
        if read is not None:
            read(old_url)
        old.stop()
        return self._event(
            {
                "event": "deployed",
                "version": version,
                "url": new.url,
                "start_s": started - t0,
                "switched": started,
                "drained": drained,
            }
        )

    def follow(self, root: Path, stop: threading.Event, poll_s: float, read=None) -> None:
        """Deploy each new ROOT/current until `stop`; a version that does not start is an
        event, and the current server keeps serving."""
        while not stop.wait(poll_s):
            current = read_current(root)
            if current is None or current == self.version:
                continue
            try:
                self.deploy(current, read)
            except (VllmError, OSError) as e:
                self._event({"event": "deploy_failed", "version": current, "error": str(e)[:500]})
                self.version = current  # not retried: the next promotion is

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        if self.server is not None:
            self.server.stop()

    def _event(self, event: dict) -> dict:
        event["time"] = time.time()
        self.events.append(event)
        _log(self.out / "deployments.jsonl", event)
        print(f"online demo (vllm): {json.dumps(event)}", flush=True)
        return event


class Scraper:
    """Served acceptance from the engine's counters: one window per reading of the server
    the proxy sends to (served.jsonl); a window with at least `min_rounds` rounds whose α
    falls more than `drop` below the mean of the `trailing` windows before it calls
    `trigger` (then the trailing level starts again)."""

    def __init__(
        self,
        log: Path,
        trigger: Callable[[], None] | None = None,
        *,
        drop: float = 0.1,
        trailing: int = 3,
        min_rounds: int = 100,
    ):
        self.log, self.trigger = log, trigger
        self.drop, self.trailing, self.min_rounds = drop, trailing, min_rounds
        self.last: dict[str, ServedCounters] = {}
        self.windows: list[dict] = []
        self.errors = 0
        self._level: list[float] = []
        self._lock = threading.Lock()

    def read(self, url: str) -> dict | None:
        """One reading of `url`: the window since its last reading (None on the first)."""
        with self._lock:
            try:
                counters = scrape(url)
            except MetricsError:
                self.errors += 1
                return None
            before, self.last[url] = self.last.get(url), counters
            if before is None:
                return None
            window = ServedWindow.between(before, counters)
            entry = {"url": url, **window.as_dict(), "triggered": self._check(window)}
            self.windows.append(entry)
            _log(self.log, entry)
            return entry

    def _check(self, window: ServedWindow) -> bool:
        if window.drafts < self.min_rounds or window.alpha is None:
            return False
        level = self._level[-self.trailing :]
        fired = len(level) == self.trailing and window.alpha < sum(level) / len(level) - self.drop
        if fired:
            self._level = []
            if self.trigger is not None:
                self.trigger()
        self._level.append(window.alpha)
        return fired

    def run(self, deployment: Deployment, stop: threading.Event, interval: float) -> None:
        self.read(deployment.upstream)
        while not stop.wait(interval):
            self.read(deployment.upstream)


def convert_loop(log: Path, tokenizer, target: dict, traffic: Path, stop, every: float) -> None:
    """Convert the proxy's complete lines into the traffic log every `every` seconds (a
    snapshot cut at the last newline: a line being written is taken next time), and once
    more when `stop` is set."""
    snapshot = traffic.parent / "proxy-snapshot.jsonl"
    while True:
        stopping = stop.wait(every)
        if log.exists():
            data = log.read_bytes()
            snapshot.write_bytes(data[: data.rfind(b"\n") + 1])
            convert("vllm", [snapshot], tokenizer, target, traffic)
        if stopping:
            return


def exporter(root: Path, out: Path, load_version) -> Callable[[str], tuple[str, Mapping]]:
    """export(version): ROOT/version written as its vLLM export under OUT/exports (once)."""

    def export(version: str) -> tuple[str, Mapping]:
        draft = load_version(version)
        if draft is None:
            raise VllmError(f"{version} does not load")
        speculation = speculation_of(draft)
        path = out / "exports" / version
        if not path.exists():
            export_draft(draft, str(version_draft_dir(root, version)), path)
        return str(path), speculation

    return export


def serve_behind_vllm(args, out: Path, job, load) -> dict:
    """vLLM on ROOT/current behind the proxy, the traffic converted as it comes, the online
    job following it on a thread, served acceptance scraped, each promotion redeployed; the
    load (`load(url, body)`: the clients' run) against the proxy. Then everything stops:
    {"load", "job_result", "job_errors", "deployments", "windows", "proxy"}."""
    root = out / "drafts"
    cores = len(os.sched_getaffinity(0))  # vLLM leaves one core to the job (two: one each)
    engine = VllmSettings(
        kv_cache_gib=1.0, max_num_seqs=max(4, args.clients), threads=max(1, cores - 1)
    )
    settings = VllmServerSettings(
        target=hub.local_model_dir(args.target) or args.target,  # embedded, registry: built
        name=SERVED_NAME,
        engine=engine,
        gamma=args.gamma,
        max_logprobs=args.top_logprobs,
        max_model_len=context_cut(args.target, 1024),
    )
    deployment = Deployment(settings, exporter(root, out, job.load_version), out)
    url = deployment.start(read_current(root))
    trigger = job.request_refresh if args.trigger_drop > 0 else None
    scraper = Scraper(out / "served.jsonl", trigger, drop=args.trigger_drop)
    target = {"name": args.target, "identity": model_identity(args.target)}
    stop, job_result, job_errors = threading.Event(), {}, []

    def run_job():
        try:
            job_result.update(job.run(follow=True))
        except BaseException as e:  # noqa: BLE001 - reported in the summary
            job_errors.append(repr(e))

    workers = [
        threading.Thread(target=run_job, name="online-job", daemon=True),
        threading.Thread(
            target=convert_loop,
            args=(out / "proxy-log.jsonl", job.tokenizer, target, out / "traffic", stop, 2.0),
            daemon=True,
        ),
        threading.Thread(target=scraper.run, args=(deployment, stop, args.scrape_s), daemon=True),
        threading.Thread(
            target=deployment.follow, args=(root, stop, 1.0, scraper.read), daemon=True
        ),
    ]
    for w in workers:
        w.start()
    try:
        result = load(url, vllm_body)
    finally:
        scraper.read(deployment.upstream)
        stop.set()
        for w in workers[1:]:
            w.join(timeout=600)
        job.stop_event.set()
        workers[0].join(timeout=max(60.0, args.minutes * 60))
        deployment.stop()
    if workers[0].is_alive():
        job_errors.append("the online job did not stop in time")
    return {
        "load": result,
        "job_result": job_result,
        "job_errors": job_errors,
        "deployments": deployment.events,
        "windows": scraper.windows,
        "scrape_errors": scraper.errors,
        "proxy": dict(deployment.proxy.counts),
    }
