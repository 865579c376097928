"""`specdistill regenerate`'s sampling parameters and size arguments, checked in one place
(train/regenerate.py)."""

import math
from dataclasses import dataclass

from specdistill.errors import UserError
from specdistill.eval.cli_args import MAX_SEED


class RegenerateError(UserError):
    """An argument out of range, or an output directory that this run cannot continue."""


@dataclass
class Sampling:
    temperature: float = 0.7
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int = 256
    seed: int = 0

    def check(self) -> "Sampling":
        """Raise RegenerateError naming the first parameter out of range; return self."""
        t, p, k, n = self.temperature, self.top_p, self.top_k, self.max_new_tokens
        if not _number(t) or not math.isfinite(t) or t < 0:
            raise RegenerateError(f"--temperature must be a finite number >= 0, got {t!r}")
        if p is not None and not (_number(p) and 0 < p <= 1):
            raise RegenerateError(f"--top-p must be in (0, 1], got {p!r}")
        if k is not None and not (_integer(k) and k >= 1):
            raise RegenerateError(f"--top-k must be an integer >= 1, got {k!r}")
        if not (_integer(n) and n >= 1):
            raise RegenerateError(f"--max-new-tokens must be an integer >= 1, got {n!r}")
        if not (_integer(self.seed) and 0 <= self.seed <= MAX_SEED):
            raise RegenerateError(
                f"--seed must be an integer in [0, 2**63 - 1] (a torch seed, offset per "
                f"prompt), got {self.seed!r}"
            )
        return self


def _number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_sizes(**sizes) -> None:
    """Each of `sizes` (name -> value, `retries` from 0, the others from 1) in range."""
    for name, value in sizes.items():
        low = 0 if name == "retries" else 1
        if value is not None and not (_integer(value) and value >= low):
            flag = "--" + name.replace("_", "-")
            raise RegenerateError(f"{flag} must be an integer >= {low}, got {value!r}")
