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

Limits (vLLM's names where vLLM has the flag): --max-model-len (prompt + completion tokens;
more is a 400 naming both numbers), --max-num-seqs (rows decoded together), --max-queue
(requests waiting beyond them; past that a 503 with Retry-After at once, never a stall),
--max-body-bytes (413 past it), --max-prompt-chars (checked before tokenising),
--max-messages, --body-timeout-s (408 for a body slower than that; a request is admitted
only once its body is read), --drain-s (on SIGTERM, how long running requests may take).
Every option, with its type, default and bounds, is a field of `ServeOptions`
(serve/options.py), which `Server` takes; a value out of bounds is one line naming the flag,
before a model loads. Every option with its default: docs/cli.md.

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
import sys
from collections.abc import Sequence

from specdistill.errors import run_guarded
from specdistill.serve.flags import add_flags, parse_options
from specdistill.serve.options import ServeOptions
from specdistill.threads import ThreadPolicy
from specdistill.verb_parser import quiet_third_party, verb_parser

log = logging.getLogger("specdistill.serve")
API_KEY_ENV = "SPECDISTILL_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    """The verb's parser: one flag per `ServeOptions` field (serve/flags.py)."""
    parser = verb_parser("serve", __doc__)
    add_flags(parser, ServeOptions)
    return parser


def with_api_key(options: ServeOptions) -> tuple[ServeOptions, str]:
    """(options, where the key came from): --api-key, else $SPECDISTILL_API_KEY."""
    if options.api_key is not None:
        return options, "--api-key"
    return options.model_copy(update={"api_key": os.environ.get(API_KEY_ENV)}), API_KEY_ENV


def set_threads(threads: int | None, device: str | None) -> ThreadPolicy | None:
    """--threads, else the cores free at start-up (specdistill/threads.py), which the engine
    worker re-checks between rounds; on a GPU only a forced count is set."""
    import torch  # lazy: --help loads no torch

    on_cpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu"
    if threads is None and not on_cpu:
        return None
    policy = ThreadPolicy(threads, say=log.info)
    policy.start()
    return policy


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_options(build_parser(), argv)
    quiet_third_party()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # lazy: --help loads no fastapi
    from specdistill.serve.auth import ApiKeys, check_bind, parse_keys
    from specdistill.serve.server import Server  # lazy: --help loads no torch

    options, source = with_api_key(options)
    check_bind(options.host, ApiKeys(parse_keys(options.api_key, source)), options.insecure)
    server = Server(options, threads=set_threads(options.threads, options.device))
    server.serve(options.host, options.port)
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded(main, sys.argv[1:]))
