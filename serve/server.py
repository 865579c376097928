"""`specdistill serve`: an OpenAI-compatible server decoding with lossless speculative decoding.

    specdistill serve --target embedded:code-deep --draft runs/code/final --port 8000
    specdistill serve --target Qwen/Qwen2.5-7B-Instruct --drafts runs/published --traffic logs/
    specdistill serve --target embedded:code-deep --draft none   # the target alone (baseline)
    specdistill serve --target embedded:code --target-adapter runs/drift-demo/adapter \\
        --draft runs/drift-demo/repair/refit/final      # a fine-tuned target: base + LoRA, unmerged

Endpoints: POST /v1/completions, POST /v1/chat/completions (stream, logprobs, stop, seed),
GET /v1/models, GET /health, GET /metrics (Prometheus). One engine thread owns the models
and batches every request in flight (continuous batching, per-request sampling parameters
and seeds: eval/engine.py `Engine`); requests join the running batch between rounds.

--drafts ROOT serves the version ROOT/current names (ROOT/v000001/, ...) and watches it:
a newly published version is loaded beside the old one, checked against the target and
serves new requests from the next round on; one that fails is logged and skipped
(serve/drafts.py). --traffic DIR appends one JSON line per completed request
(docs/traffic.md, serve/traffic.py).
"""

import argparse
import logging
import socket
import threading
import time
from collections.abc import Sequence

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
        gamma: int = 4,
        max_batch: int = 8,
        traffic: str | None = None,
        log_top_logprobs: int = 0,
        poll_s: float = 2.0,
        dtype: str = "float32",
        device: str | None = None,
        model_name: str | None = None,
        default_max_tokens: int = 16,
        shard_bytes: int | None = None,
        target_adapter: str | None = None,
    ):
        import torch

        from specdistill.drafts.hub import load_target, load_tokenizer
        from specdistill.serve.app import AppState, ServerConfig, build_app
        from specdistill.serve.drafts import DraftWatcher, load_checked
        from specdistill.serve.traffic import DEFAULT_SHARD_BYTES, TrafficLog, model_identity
        from specdistill.serve.worker import EngineWorker

        if draft is not None and drafts_root is not None:
            raise ValueError("give --draft or --drafts, not both")
        if gamma < 1:
            raise ValueError(f"--gamma must be >= 1, got {gamma}")
        if max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
        if not 0 <= log_top_logprobs <= 20:
            raise ValueError(f"--log-top-logprobs must be in [0, 20], got {log_top_logprobs}")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = load_tokenizer(target)
        # A peft adapter stays unmerged (drafts.hub.load_target); the identity the traffic
        # records carry covers its files, so the online job refuses records of another adapter
        # or of the bare base.
        self.target = load_target(target, target_adapter, dtype=dtype).to(device).eval()
        identity = model_identity(target, self.target, target_adapter)
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
            capacity=max_batch,
            eos_token_id=self.tokenizer.eos_token_id,
            vocab_size=len(self.tokenizer),
        )
        self.traffic = TrafficLog(traffic, shard_bytes or DEFAULT_SHARD_BYTES) if traffic else None
        config = ServerConfig(
            model_name=model_name or target,
            target_name=target if not target_adapter else f"{target}+{target_adapter}",
            target_identity=identity,
            default_max_tokens=default_max_tokens,
            log_top_logprobs=log_top_logprobs if traffic else 0,
        )
        self.state = AppState(self.tokenizer, self.worker, config, self.traffic)
        self.app = build_app(self.state)
        self._uvicorn = None
        self._thread = None

    def _install(self, draft, version: str) -> None:
        self.worker.swap(draft, version)

    def _begin(self) -> None:
        self.worker.start()
        if self.watcher is not None:
            self.watcher.start()

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on a background thread; the base URL (port 0: a free port)."""
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        port = sock.getsockname()[1]
        self._begin()
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off")
        self._uvicorn = uvicorn.Server(config)
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
        """Serve in the foreground until interrupted."""
        import uvicorn

        self._begin()
        try:
            uvicorn.run(self.app, host=host, port=port, log_level="info", lifespan="off")
        finally:
            self.stop()

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            self._thread.join(timeout=10)
        if self.watcher is not None:
            self.watcher.stop()
        self.worker.stop()
        if self.worker.is_alive():
            self.worker.join(timeout=10)
        if self.traffic is not None:
            self.traffic.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specdistill serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--target", required=True, help="HF id, local dir or embedded:<name>")
    parser.add_argument(
        "--target-adapter",
        default=None,
        help="a peft LoRA adapter directory put on the target, unmerged (the target identity "
        "in the traffic log covers its files)",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--draft", help="draft dir / HF id / embedded:<name>, or 'none'")
    source.add_argument("--drafts", help="a published root: ROOT/vNNNNNN/ + ROOT/current")
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens per round (>= 1)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
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
    parser.add_argument("--max-batch", type=int, default=8, help="rows decoded together")
    parser.add_argument("--poll-s", type=float, default=2.0, help="--drafts: seconds between polls")
    parser.add_argument("--max-tokens", type=int, default=16, help="default max_tokens")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op CPU threads")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    server = Server(
        args.target,
        args.draft,
        drafts_root=args.drafts,
        gamma=args.gamma,
        max_batch=args.max_batch,
        traffic=args.traffic,
        log_top_logprobs=args.log_top_logprobs,
        poll_s=args.poll_s,
        dtype=args.dtype,
        device=args.device,
        model_name=args.served_model_name,
        default_max_tokens=args.max_tokens,
        shard_bytes=int(args.traffic_shard_mb * 1024 * 1024),
        target_adapter=args.target_adapter,
    )
    server.serve(args.host, args.port)
    return 0


if __name__ == "__main__":
    import sys

    from specdistill.errors import run_guarded

    sys.exit(run_guarded(main, sys.argv[1:]))
