"""Shared inputs for the loss tests."""

import math
import typing

import torch

from specdistill.losses.declaration import Param

# Params that make every registered loss runnable on a small vocabulary.
PARAMS = {
    "jsd": {"beta": 0.3},
    "topk_ce": {"k": 2},
    "mix": {"parts": {"tv": 0.7, "fkl": 0.2, "lk_lambda": 0.1}},
}
# Losses that are divergences: minimum 0, reached at p = q.
DIVERGENCES = ["fkl", "rkl", "jsd", "tv", "lk_alpha", "lk_lambda", "mix"]


def logits_of(probs: list[float], dtype=torch.float64) -> torch.Tensor:
    """Log-probabilities as logits, −inf where p = 0."""
    return torch.tensor([math.log(x) if x > 0 else -math.inf for x in probs], dtype=dtype)


def outside(param: Param):
    """A value of `param`'s type just outside its declared bounds or choices."""
    if param.choices:
        return "no-such-choice"
    below = next((b for b in (param.ge, param.gt) if b is not None), None)
    value = below - 1 if below is not None else max(b for b in (param.le, param.lt) if b) + 1
    return int(value) if int in (param.type, *typing.get_args(param.type)) else float(value)
