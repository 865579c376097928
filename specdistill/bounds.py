"""Bounds on the numbers a user gives: one check for every flag and recipe key.

A size the machine cannot hold (a batch of 10**30, 10**9 bootstrap draws or threads) or a
threshold that can never fire (a drop above 2 when drops are fractions) is refused before
anything loads or is written, in one line naming the setting and its allowed range:

    check_int("--bootstrap", value, 1, MAX_BOOTSTRAP)      # -> value, or BoundsError
    check_float("--fail-if-drop-above", value, 0.0, 1.0)
    parser.add_argument("--max-gamma", type=int_in(1, MAX_GAMMA))   # a usage error (exit 2)

The limits here are what the project's own arrays can hold on a machine, not what a model
can: a length beyond a target's context is checked against that target (`context_limit`).
Standard library and specdistill/errors.py only.
"""

import argparse
import math
import os

from specdistill.errors import UserError

THREADS_PER_CORE = 4  # more intra-op threads than this per core only thrash
MAX_GAMMA = 64  # drafts per round: far beyond any useful γ
MAX_BOOTSTRAP = 100_000  # bootstrap draws: the intervals settle long before
MAX_BATCH = 1 << 20  # sequences in one batch (global or per device)
MAX_CONTEXT = 1 << 24  # tokens: beyond any model's context (the target's is checked too)
MAX_PROMPTS = 1 << 20  # prompts of one measurement, each answered by two targets


class BoundsError(UserError):
    """A number outside the range its setting allows."""


def max_threads() -> int:
    """The most intra-op threads a verb takes: `THREADS_PER_CORE` per core of the machine."""
    return THREADS_PER_CORE * (os.cpu_count() or 1)


def _range(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f"in [{low:g}, {high:g}]"
    return f">= {low:g}" if low is not None else f"<= {high:g}"


def check_int(name: str, value, low: int | None = None, high: int | None = None, why: str = ""):
    """`value` when it is an integer (not a bool) within [low, high]; BoundsError naming
    `name`, the range and `why` (the limit's reason) otherwise."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    ok = ok and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        big = isinstance(value, int) and abs(value) >= 10**15
        shown = f"{value:.3g}" if big else repr(value)
        reason = f" ({why})" if why else ""
        raise BoundsError(f"{name} must be an integer {_range(low, high)}{reason}, got {shown}")
    return value


def check_float(
    name: str, value, low: float | None = None, high: float | None = None, why: str = ""
) -> float:
    """`value` as a float when it is a finite number within [low, high]; BoundsError naming
    `name` and the range otherwise."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    ok = number and math.isfinite(float(value))
    ok = ok and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        reason = f" ({why})" if why else ""
        raise BoundsError(
            f"{name} must be a finite number {_range(low, high)}{reason}, got {value!r}"
        )
    return float(value)


def int_in(low: int, high: int | None = None):
    """argparse type: an integer in [low, high] (a usage error naming the range otherwise)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"needs an integer {_range(low, high)}; got {text!r}"
            ) from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"needs an integer {_range(low, high)}; got {text!r}")
        return value

    return parse


def float_in(low: float, high: float):
    """argparse type: a finite number in [low, high]."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"needs a number in [{low:g}, {high:g}]; got {text!r}")
        return value

    return parse


def context_limit(name: str, value: int | None, context: int | None, model: str) -> None:
    """BoundsError when `value` (a token count) exceeds `context`, the model's
    `max_position_embeddings` (None: unknown, nothing checked)."""
    if value is None or context is None or value <= context:
        return
    shown = f"{value:.3g}" if value >= 10**15 else str(value)
    raise BoundsError(
        f"{name} = {shown} is beyond the context of {model} ({context} positions, its "
        f"max_position_embeddings): set it to at most {context}"
    )
