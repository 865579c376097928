"""`specdistill proxy`: the logging proxy (serve/proxy.py) in front of vLLM's OpenAI server, so
that what it serves becomes the online job's traffic (`specdistill convert-traffic --from
vllm --input LOG`).

    specdistill proxy --upstream http://127.0.0.1:8001 --log proxy-log.jsonl --port 8000

Clients send completions and chat completions to the proxy's port; each answered request is
appended to LOG as one line. Ask vLLM for what the job learns from: `logprobs` (with vLLM
started with `--max-logprobs`), `return_token_ids`, and start vLLM with
`--per-request-spec-decode-metrics summary`. Runs until SIGINT or SIGTERM.
"""

import signal
import sys
import threading
from pathlib import Path

from specdistill.errors import UserError, run_guarded
from specdistill.serve.proxy import LoggingProxy
from specdistill.verb_parser import verb_parser


def build_parser():
    parser = verb_parser("proxy", __doc__)
    parser.add_argument("--upstream", required=True, help="the engine's URL (vLLM's server)")
    parser.add_argument("--log", required=True, help="JSON lines file to append to")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--max-body", type=int, default=1 << 20, help="largest request, bytes")
    parser.add_argument("--max-in-flight", type=int, default=64, help="requests at once")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.upstream.startswith(("http://", "https://")):
        raise UserError(f"--upstream must be an http(s) URL, got {args.upstream!r}")
    log = Path(args.log)
    if not log.parent.is_dir():
        raise UserError(f"--log {log}: its directory does not exist")
    proxy = LoggingProxy(
        args.upstream,
        log,
        max_body=args.max_body,
        max_in_flight=args.max_in_flight,
        timeout=args.timeout,
    )
    url = proxy.start(args.host, args.port)
    print(f"proxy on {url} -> {args.upstream}, logging to {log}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    proxy.stop()
    print(f"proxy stopped: {proxy.counts}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded(main, sys.argv[1:]))
