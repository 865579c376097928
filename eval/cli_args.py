"""Argument types and checks shared by the command lines that decode with the target.

`specdistill speculate`, `drift`, `regenerate` and `serve` take the same kinds of option:
counts, top-p / top-k filters, a sampling seed, γ and its defaults (`parse_gamma`; the
policy a γ names: eval/length_policy.py), a torch device and an output directory. The argparse
types here refuse a bad value with a usage error (exit 2) naming the option, before anything
loads; the device check imports torch, so it runs when the models are about to load. Imports
no model library at import time.
"""

import argparse
import math
import os
from pathlib import Path
from typing import Literal

from specdistill.errors import UserError

# Seeds are offset per request or per batch (regenerate adds a 32-bit prompt hash and the
# attempt); below 2**63 every such sum still fits the 64 bits a torch generator takes.
MAX_SEED = 2**63 - 1
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")  # the devices the models can be put on
DEFAULT_GAMMA = 4  # drafts per round when none is given (and for a draft without a head)
DEFAULT_MAX_GAMMA = 8  # most drafts per row and round under "auto"


def at_least(low: int):
    """argparse type: an integer >= `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"needs an integer >= {low}; got {text!r}")
        return value

    return parse


def top_p(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"needs a number in (0, 1]; got {text!r}")
    return value


def seed(text: str) -> int:
    """argparse type: an integer in [0, 2**63 - 1], a seed a torch generator takes."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(
            f"needs an integer in [0, {MAX_SEED}] (2**63 - 1); got {text!r}"
        )
    return value


def parse_gamma(value: int | str) -> int | Literal["auto"]:
    """A γ as a command line gives it: an integer >= 1 (or its text) or "auto"; ValueError
    naming the value otherwise."""
    if value == "auto":
        return "auto"
    try:
        gamma = int(value)
    except (TypeError, ValueError):
        gamma = 0
    if isinstance(value, bool) or gamma < 1 or (isinstance(value, float) and value != gamma):
        raise ValueError(f"must be an integer >= 1 or 'auto', got {value!r}")
    return gamma


def resolve_device(name: str | None) -> str:
    """The device to run on: `name` itself, or for "auto" (or None) cuda when present, else
    cpu.

    UserError naming `--device` when it is no device of `DEVICE_TYPES` or this machine lacks it
    (cuda without CUDA, an index past the last GPU).
    """
    import torch  # lazy: the verbs' parsers import this module; --help loads no torch

    if name in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        device = None
    if device is None or device.type not in DEVICE_TYPES:
        raise UserError(
            f"--device {name!r}: not a device torch knows; use cpu, cuda, cuda:N, mps, xpu or auto"
        )
    try:
        torch.empty(1, device=device).add_(1)
    except (RuntimeError, AssertionError, ValueError) as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise UserError(f"--device {name}: not available on this machine ({reason})") from None
    return name


def make_dir(out: str | os.PathLike, option: str = "--out") -> Path:
    """The directory `out`, created if new; UserError naming `option` when it is a file or
    cannot be created."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{option} {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{option} {out}: cannot create it ({e.strerror or e})") from None
    return out
