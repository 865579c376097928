"""The served sampling a step's loss is taken at (`loss.temperature`): one temperature, a
distribution of served temperatures, or each traffic record's own temperature and top-p.

A step asks its `SamplingSource` for the `Share`s of a micro-batch and sums the loss of each
share, weighted: a distribution {T: w} gives every row one share per temperature (the loss is
the exact expectation over the mixture, from one forward of each model); `traffic` gives each
group of rows served alike (same temperature and top-p) one share of weight 1. Temperature 0
(greedy) has no gradient of its own (agreement of argmaxes): its share is trained at
temperature 1, the smooth objective whose optimum (q = p) also matches the argmax, and
reported as greedy agreement by the evaluation.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from specdistill.train.recipe_errors import RecipeError

# The loss temperature of a greedy (T = 0) share.
GREEDY_LOSS_TEMPERATURE = 1.0


@dataclass(frozen=True)
class Share:
    """Part of a micro-batch's loss: the served ``temperature`` (0: greedy), its ``weight``,
    the served ``top_p`` (None: the recipe's loss.top_p) and the rows it covers (``rows``
    [B] bool; None: every row)."""

    temperature: float
    weight: float = 1.0
    top_p: float | None = None
    rows: Tensor | None = None

    @property
    def loss_temperature(self) -> float:
        return self.temperature if self.temperature > 0 else GREEDY_LOSS_TEMPERATURE

    def params(self, params: dict) -> dict:
        """The loss parameters with this share's top-p (a served top-p of 1 is off)."""
        if self.top_p is None:
            return params
        return {**params, "top_p": None if self.top_p >= 1.0 else self.top_p}

    def mask(self, mask: Tensor) -> Tensor:
        """`mask` [B, ...] restricted to this share's rows."""
        if self.rows is None:
            return mask
        rows = self.rows.to(mask.device)
        return mask & rows.view(-1, *([1] * (mask.dim() - 1)))


class SamplingSource(Protocol):
    indexed: bool  # True: batches must carry "sequence" (dataset indices of their rows)

    def shares(self, batch: dict) -> list[Share]: ...


def mixture(temperature) -> dict[float, float]:
    """loss.temperature as {temperature: weight} (a single temperature has weight 1)."""
    if temperature == "traffic":
        raise RecipeError(
            "loss.temperature=traffic takes each traffic record's own sampling: only "
            "`specdistill online` has records; give a temperature or a {temperature: weight} "
            "distribution",
            key="loss.temperature",
        )
    if isinstance(temperature, dict):
        return {float(t): float(w) for t, w in temperature.items()}
    return {float(temperature): 1.0}


def is_mixture(temperature) -> bool:
    """Whether loss.temperature is a distribution of several served temperatures."""
    return isinstance(temperature, dict)


class FixedShares:
    """Every row at every temperature of a {temperature: weight} distribution."""

    indexed = False

    def __init__(self, temperature):
        self.list = [Share(t, w) for t, w in mixture(temperature).items()]

    def shares(self, batch: dict) -> list[Share]:
        return self.list


class ServedSampling(Protocol):
    """A record's served sampling (train/online/kept.py `KeptRecord`)."""

    temperature: float
    top_p: float | None


class TrafficShares:
    """Each row at its traffic record's own temperature and top-p (``items``: the online
    store's records, by dataset index)."""

    indexed = True

    def __init__(self, items: Sequence[ServedSampling]):
        self.sampling = [(float(it.temperature), it.top_p) for it in items]

    def shares(self, batch: dict) -> list[Share]:
        sequence = batch["sequence"].tolist()
        groups: dict[tuple, list[int]] = {}
        for row, index in enumerate(sequence):
            groups.setdefault(self.sampling[index], []).append(row)
        shares = []
        for (temperature, top_p), rows in groups.items():
            mask = torch.zeros(len(sequence), dtype=torch.bool)
            mask[rows] = True
            shares.append(Share(temperature, 1.0, top_p, mask))
        return shares


def sampling_source(recipe) -> SamplingSource | None:
    """The recipe's source (None for `traffic`, which the online job sets per refresh)."""
    if recipe.loss.temperature == "traffic":
        return None
    return FixedShares(recipe.loss.temperature)
