"""`specdistill serve`: an OpenAI-compatible server decoding with lossless speculative decoding.

    specdistill serve --target embedded:code-deep --draft runs/code/final --port 8000
    specdistill serve --target Qwen/Qwen2.5-7B-Instruct --drafts runs/published --traffic logs/
    specdistill serve --target embedded:code-deep --draft none   # the target alone (baseline)
    specdistill serve --target embedded:code --target-adapter runs/drift-demo/adapter \\
        --draft runs/drift-demo/repair/refit/final      # a fine-tuned target: base + LoRA, unmerged

Endpoints: POST /v1/completions, POST /v1/chat/completions (stream, logprobs, stop, seed),
GET /v1/models, GET /health, GET /metrics (Prometheus). One engine thread owns the models
and batches every request in flight (continuous batching, per-request sampling parameters
and seeds: eval/engine.py `Engine`); requests join the running batch between rounds. One
2-token generation warms the engine before anything answers, /health included.

--drafts ROOT serves the version ROOT/current names (ROOT/v000001/, ...) and watches it:
a newly published version is loaded beside the old one, checked against the target and
serves new requests from the next round on; one that fails is logged and skipped
(serve/drafts.py). --traffic DIR appends one JSON line per completed request
(docs/traffic.md, serve/traffic.py).

Limits (vLLM's names where vLLM has the flag; `Server(...)` takes the same as keywords):
--max-model-len (prompt + completion tokens; more is a 400 naming both numbers),
--max-num-seqs (rows decoded together), --max-queue (requests waiting beyond them; past
that a 503 with Retry-After at once, never a stall), --max-body-bytes (413 past it),
--max-prompt-chars (checked before tokenising), --max-messages, --body-timeout-s (408 for
a body slower than that; a request is admitted only once its body is read), --drain-s (on
SIGTERM, how long running requests may take). Every value is checked before a model loads
(serve/flags.py). Every option with its default: docs/cli.md.

Draft length: --gamma N|auto. "auto" sets each row's length every round from the acceptance
head's predictions and the cost of a round measured at the current batch size
(eval/length_policy.py `AutoGamma`), so a loaded server drafts less and runs plain target
rounds when drafting cannot pay; the default for a draft with an acceptance head (4
otherwise), decided again for each hot-swapped version. --max-gamma caps it.

Fixed per request (serve/schema.py): JSON nesting depth <= 32 (counted before parsing), at
most 16 stop strings of at most 256 characters, top logprobs <= 20.

Authentication: --api-key KEY[,KEY...] (or $SPECDISTILL_API_KEY; an empty key is refused)
is required as `Authorization: Bearer KEY` on /v1/* and the OpenAPI pages (/openapi.json,
/docs, /redoc), 401 otherwise; /health and /metrics stay open. Serving
on a host beyond loopback without a key is refused at start-up unless --insecure. Traffic
records name the key a request used (`client`: `key-` + sha256(key)[:12]).

Errors are OpenAI-shaped for every status: {"error": {"message", "type", "param", "code"}}.
Unknown fields and OpenAI fields this server does not implement (echo, suffix, logit_bias,
non-zero penalties, response_format other than text, tools, functions) are a 400 naming the
field; a `model` other than the served name is a 404.
"""

import argparse
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence

from specdistill.errors import UserError
from specdistill.eval.cli_args import resolve_device
from specdistill.serve.flags import check_limits, check_traffic_dir, parse_gamma
from specdistill.serve.uvicorn_server import _Uvicorn
from specdistill.threads import ThreadPolicy
from specdistill.verb_parser import quiet_third_party, verb_parser

log = logging.getLogger("specdistill.serve")


class Server:
    """Models, engine worker, draft watcher, traffic log and the FastAPI app, in one object.

    `start()` runs uvicorn on a background thread (tests, benchmarks) and returns the base
    URL; `serve()` runs it in the foreground (the CLI); `stop()` ends everything.
    """

    def __init__(
        self,
        target: str,
        draft: str | None = None,
        *,
        drafts_root: str | None = None,
        gamma: int | str | None = None,
        max_gamma: int = 8,
        max_num_seqs: int | None = None,
        max_batch: int | None = None,
        traffic: str | None = None,
        log_top_logprobs: int = 0,
        poll_s: float = 2.0,
        dtype: str = "float32",
        device: str | None = None,
        model_name: str | None = None,
        default_max_tokens: int = 16,
        shard_bytes: int | None = None,
        target_adapter: str | None = None,
        max_model_len: int | None = None,
        max_queue: int = 64,
        max_body_bytes: int = 1 << 20,
        max_prompt_chars: int | None = None,
        max_messages: int = 1024,
        api_key: str | Sequence[str] | None = None,
        insecure: bool = False,
        drain_s: float = 30.0,
        threads: ThreadPolicy | None = None,
        body_timeout_s: float = 30.0,
    ):
        from specdistill.drafts.hub import load_target, load_tokenizer
        from specdistill.drafts.identity import model_identity
        from specdistill.serve.app import AppState, ServerConfig, build_app
        from specdistill.serve.auth import ApiKeys, parse_keys
        from specdistill.serve.drafts import DraftWatcher, WatchMetrics, load_checked
        from specdistill.serve.schema import Limits
        from specdistill.serve.traffic import DEFAULT_SHARD_BYTES, TrafficLog
        from specdistill.serve.worker import EngineWorker

        if draft is not None and drafts_root is not None:
            raise UserError("give --draft or --drafts, not both")
        gamma = parse_gamma(gamma)
        if max_num_seqs is not None and max_batch is not None and max_num_seqs != max_batch:
            raise UserError("give --max-num-seqs or its alias --max-batch, not both")
        max_num_seqs = max_num_seqs or max_batch or 8
        check_limits(
            max_num_seqs=max_num_seqs,
            max_queue=max_queue,
            max_body_bytes=max_body_bytes,
            max_messages=max_messages,
            default_max_tokens=default_max_tokens,
            max_prompt_chars=max_prompt_chars,
            max_model_len=max_model_len,
            max_gamma=max_gamma,
            log_top_logprobs=log_top_logprobs,
            drain_s=drain_s,
            poll_s=poll_s,
            body_timeout_s=body_timeout_s,
            shard_bytes=shard_bytes,
        )
        check_traffic_dir(traffic)
        device = resolve_device(device)
        self.keys = ApiKeys(parse_keys(api_key))
        self.insecure, self.drain_s = insecure, drain_s
        self.tokenizer = load_tokenizer(target)
        # A peft adapter stays unmerged (drafts.hub.load_target); the identity the traffic
        # records carry covers its files, so the online job refuses records of another adapter
        # or of the bare base.
        self.target = load_target(target, target_adapter, dtype=dtype).to(device).eval()
        identity = model_identity(target, self.target, target_adapter)
        context = getattr(self.target.config, "max_position_embeddings", None)
        if max_model_len is None:
            if not context:
                raise UserError(
                    f"{target}: its config names no max_position_embeddings; give --max-model-len"
                )
            max_model_len = context
        elif context and max_model_len > context:
            log.warning(
                "--max-model-len %d is beyond the target's context (%d positions): outputs "
                "past it depend on how the model extrapolates",
                max_model_len,
                context,
            )
        if max_prompt_chars is None:
            max_prompt_chars = max(16 * max_model_len, 4096)
        self.limits = Limits(
            max_model_len=max_model_len,
            default_max_tokens=default_max_tokens,
            max_body_bytes=max_body_bytes,
            max_prompt_chars=max_prompt_chars,
            max_messages=max_messages,
        )
        self.watcher = None
        version = None
        draft_model = None
        if drafts_root is not None:
            self.watcher = DraftWatcher(
                drafts_root,
                self.target,
                self.tokenizer,
                self._install,
                poll_s=poll_s,
                dtype=dtype,
            )
            found = self.watcher.poll()
            if found is not None:
                draft_model, version = found
            else:
                log.warning(
                    "%s: no loadable draft version yet; serving the target alone", drafts_root
                )
        elif draft is not None and draft != "none":
            draft_model = load_checked(draft, self.target, self.tokenizer, dtype=dtype)
            version = draft
        self.worker = EngineWorker(
            self.target,
            draft_model,
            version,
            gamma=gamma,
            max_gamma=max_gamma,
            capacity=max_num_seqs,
            eos_token_id=self.tokenizer.eos_token_id,
            vocab_size=len(self.tokenizer),
            threads=threads,
        )
        self.traffic = TrafficLog(traffic, shard_bytes or DEFAULT_SHARD_BYTES) if traffic else None
        config = ServerConfig(
            model_name=model_name or target,
            target_name=target if not target_adapter else f"{target}+{target_adapter}",
            target_identity=identity,
            limits=self.limits,
            log_top_logprobs=log_top_logprobs if traffic else 0,
            max_num_seqs=max_num_seqs,
            max_queue=max_queue,
            max_gamma=max(max_gamma, gamma if isinstance(gamma, int) else 0),
            body_timeout_s=body_timeout_s,
        )
        self.state = AppState(self.tokenizer, self.worker, config, self.traffic, self.keys)
        if self.watcher is not None:  # the watch's failed polls in /health and /metrics
            self.state.watcher = self.watcher
            self.state.metrics.registry.register(WatchMetrics(self.watcher))
        self.app = build_app(self.state)
        self._uvicorn = None
        self._thread = None
        self.warm_up_s = warm_up(self.worker.current, self.tokenizer.eos_token_id)

    def _install(self, draft, version: str) -> None:
        self.worker.swap(draft, version)

    def _begin(self) -> None:
        self.worker.start()
        if self.watcher is not None:
            self.watcher.start()

    def _uvicorn_config(self, host: str, log_level: str, **kwargs):
        import uvicorn

        from specdistill.serve.auth import check_bind

        check_bind(host, self.keys, self.insecure)
        return uvicorn.Config(
            self.app,
            host=host,
            log_level=log_level,
            lifespan="off",
            timeout_graceful_shutdown=self.drain_s,
            **kwargs,
        )

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on a background thread; the base URL (port 0: a free port)."""
        config = self._uvicorn_config(host, "warning")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        port = sock.getsockname()[1]
        self._begin()
        self._uvicorn = _Uvicorn(config)
        self._thread = threading.Thread(
            target=self._uvicorn.run,
            kwargs={"sockets": [sock]},
            daemon=True,
            name="specdistill-http",
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return f"http://{host}:{port}"

    def serve(self, host: str = "127.0.0.1", port: int = 8000) -> None:
        """Serve in the foreground until SIGTERM or SIGINT, then drain: stop accepting, let
        running requests finish for at most `drain_s` seconds, cancel the rest, return."""
        config = self._uvicorn_config(host, "info", port=port)
        self._begin()
        try:
            _Uvicorn(config).run()
        finally:
            self.stop()

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            self._thread.join(timeout=10 + self.drain_s)
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


def set_threads(threads: int | None, device: str | None) -> ThreadPolicy | None:
    """--threads, else the cores free at start-up (specdistill/threads.py), which the engine
    worker re-checks between rounds; on a GPU only a forced count is set."""
    import torch

    on_cpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu"
    if threads is None and not on_cpu:
        return None
    policy = ThreadPolicy(threads, say=log.info)
    policy.start()
    return policy


def build_parser() -> argparse.ArgumentParser:
    parser = verb_parser("serve", __doc__)
    parser.add_argument(
        "--target", required=True, help="HF id, local dir, embedded:<name> or registry:<name>"
    )
    parser.add_argument(
        "--target-adapter",
        default=None,
        help="a peft LoRA adapter directory put on the target, unmerged (the target identity "
        "in the traffic log covers its files)",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--draft", help="draft dir / HF id / embedded:<name>, or 'none'")
    source.add_argument("--drafts", help="a published root: ROOT/vNNNNNN/ + ROOT/current")
    parser.add_argument(
        "--gamma",
        default=None,
        help="draft tokens per round (>= 1) or 'auto' (default: auto when the draft has an "
        "acceptance head, else 4). Under auto the draft lengths follow measured timings and the "
        "load: a seeded request's output is still distributed exactly as the target's, and "
        "greedy output is the target's own, but seeded sampled output is not bit-reproducible "
        "across loads or machines (a fixed --gamma keeps it reproducible)",
    )
    parser.add_argument(
        "--max-gamma", type=int, default=8, help="most draft tokens per round under --gamma auto"
    )
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="the port to listen on")
    parser.add_argument("--traffic", default=None, help="directory of the traffic log")
    parser.add_argument(
        "--traffic-shard-mb", type=float, default=64.0, help="rotate traffic shards past this size"
    )
    parser.add_argument(
        "--log-top-logprobs",
        type=int,
        default=0,
        help="log the target's top-K logprobs per token (K <= 20)",
    )
    parser.add_argument(
        "--max-num-seqs",
        "--max-batch",
        dest="max_num_seqs",
        type=int,
        default=8,
        help="rows decoded together (--max-batch: the same)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests admitted beyond the running rows; past them 503 with Retry-After",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + completion tokens per request (default: the target's "
        "max_position_embeddings); more is a 400",
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=1 << 20, help="request body cap (413 past it)"
    )
    parser.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="prompt characters, checked before tokenising (default: 16 x --max-model-len, "
        "at least 4096)",
    )
    parser.add_argument("--max-messages", type=int, default=1024, help="messages per chat request")
    parser.add_argument(
        "--api-key",
        default=None,
        help="required as 'Authorization: Bearer KEY' on /v1/*; several comma-separated "
        "(default: $SPECDISTILL_API_KEY)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow serving beyond loopback (--host) without an API key",
    )
    parser.add_argument(
        "--drain-s",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT: seconds running requests may take to finish",
    )
    parser.add_argument(
        "--body-timeout-s",
        type=float,
        default=30.0,
        help="seconds a client may take to send a request's body (408 past them); a request "
        "takes an admission slot only once its body is read",
    )
    parser.add_argument(
        "--poll-s", type=float, default=2.0, help="--drafts: seconds between polls (>= 0.05)"
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="default max_tokens")
    parser.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: --target)"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the models' dtype",
    )
    parser.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda if present)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op CPU threads (default: the cores free at start-up, re-checked)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_third_party()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from specdistill.serve.auth import ApiKeys, check_bind, parse_keys
    from specdistill.serve.flags import check_cli, shard_bytes

    check_cli(args)
    source, api_key = "--api-key", args.api_key
    if api_key is None:
        source, api_key = "SPECDISTILL_API_KEY", os.environ.get("SPECDISTILL_API_KEY")
    check_bind(args.host, ApiKeys(parse_keys(api_key, source)), args.insecure)  # before loading
    threads = set_threads(args.threads, args.device)
    server = Server(
        args.target,
        args.draft,
        drafts_root=args.drafts,
        gamma=args.gamma,
        max_gamma=args.max_gamma,
        max_num_seqs=args.max_num_seqs,
        traffic=args.traffic,
        log_top_logprobs=args.log_top_logprobs,
        poll_s=args.poll_s,
        dtype=args.dtype,
        device=args.device,
        model_name=args.served_model_name,
        default_max_tokens=args.max_tokens,
        shard_bytes=shard_bytes(args.traffic_shard_mb),
        target_adapter=args.target_adapter,
        max_model_len=args.max_model_len,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        max_prompt_chars=args.max_prompt_chars,
        max_messages=args.max_messages,
        api_key=api_key,
        insecure=args.insecure,
        drain_s=args.drain_s,
        threads=threads,
        body_timeout_s=args.body_timeout_s,
    )
    server.serve(args.host, args.port)
    return 0


if __name__ == "__main__":
    import sys

    from specdistill.errors import run_guarded

    sys.exit(run_guarded(main, sys.argv[1:]))
