"""Checks of `specdistill serve`'s options, made before anything loads.

Each bad value is one `UserError` naming the flag and the value (one line and exit 2 on the
command line), never a traceback from deep inside a library and never a server that starts
with a setting it cannot keep: a negative size, a poll interval that spins, a port that does
not exist, a file where a directory belongs (the device: eval/cli_args.py `resolve_device`).
"""

import math
import os
from pathlib import Path

from specdistill.errors import UserError

MIN_POLL_S = 0.05  # --poll-s below this re-reads the drafts root in a busy loop
MAX_PORT = 65535


def at_least(flag: str, value: float, low: float) -> None:
    """`value` must be a number >= `low` (NaN refused)."""
    if not value >= low:
        raise UserError(f"{flag} must be >= {low}, got {value}")


def finite_at_least(flag: str, value: float, low: float) -> None:
    """`value` must be a finite number >= `low`."""
    if not math.isfinite(value) or value < low:
        raise UserError(f"{flag} must be a finite number >= {low}, got {value}")


def check_limits(
    *,
    max_num_seqs: int,
    max_queue: int,
    max_body_bytes: int,
    max_messages: int,
    default_max_tokens: int,
    max_prompt_chars: int | None,
    max_model_len: int | None,
    max_gamma: int,
    log_top_logprobs: int,
    drain_s: float,
    poll_s: float,
    body_timeout_s: float,
    shard_bytes: int | None,
) -> None:
    """The server's numeric settings (a `Server`'s keywords, the flags of the same names)."""
    for flag, value, low in (
        ("--max-num-seqs", max_num_seqs, 1),
        ("--max-queue", max_queue, 0),
        ("--max-body-bytes", max_body_bytes, 1024),
        ("--max-messages", max_messages, 1),
        ("--max-tokens", default_max_tokens, 1),
        ("--max-gamma", max_gamma, 1),
    ):
        at_least(flag, value, low)
    if max_prompt_chars is not None:
        at_least("--max-prompt-chars", max_prompt_chars, 1)
    if max_model_len is not None:
        at_least("--max-model-len", max_model_len, 2)
    if shard_bytes is not None:
        at_least("--traffic-shard-mb (in bytes)", shard_bytes, 1)
    if not 0 <= log_top_logprobs <= 20:
        raise UserError(f"--log-top-logprobs must be in [0, 20], got {log_top_logprobs}")
    finite_at_least("--drain-s", drain_s, 0)
    finite_at_least("--poll-s", poll_s, MIN_POLL_S)
    finite_at_least("--body-timeout-s", body_timeout_s, 0.1)


def check_traffic_dir(path: str | None) -> None:
    """--traffic names a directory, or a path one can be made at (its nearest existing
    ancestor a writable directory)."""
    if path is None:
        return
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise UserError(f"--traffic {path}: not a directory (the traffic log is a directory)")
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"--traffic {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--traffic {path}: {existing} is not writable")


def check_cli(args) -> None:
    """The options only the command line has: the port, threads, the shard size."""
    if not 0 <= args.port <= MAX_PORT:
        raise UserError(f"--port must be in [0, {MAX_PORT}], got {args.port}")
    if args.threads is not None:
        at_least("--threads", args.threads, 1)
    finite_at_least("--traffic-shard-mb", args.traffic_shard_mb, 1 / 1024)


def shard_bytes(traffic_shard_mb: float) -> int:
    """--traffic-shard-mb in bytes."""
    return int(traffic_shard_mb * 1024 * 1024)


def parse_gamma(value: int | str | None) -> int | str | None:
    """--gamma: a number of drafts per round (>= 1), "auto", or None (the default)."""
    if value is None or value == "auto":
        return value
    try:
        gamma = int(value)
    except (TypeError, ValueError):
        raise UserError(f"--gamma must be an integer >= 1 or 'auto', got {value!r}") from None
    if isinstance(value, bool) or gamma < 1 or (isinstance(value, float) and value != gamma):
        raise UserError(f"--gamma must be an integer >= 1 or 'auto', got {value!r}")
    return gamma
