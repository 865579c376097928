"""Draft-length policies of the speculative decoding engine (eval/batch.py).

Every policy is a `LengthPolicy`: the batch asks it for each round's `RoundPlan` and tells
it what the round gave, whatever the policy. `length_policy` builds one from a γ as the
callers give it (an integer, "auto", or a policy), `GammaSetting` from a command line's
--gamma / --max-gamma (read by eval/cli_args.py `parse_gamma`, whose `DEFAULT_GAMMA` and
`DEFAULT_MAX_GAMMA` are every command line's defaults) for each draft a server loads.

`FixedGamma`: the same γ every round (γ = 0: the target alone).

`AdaptiveGamma`: one γ for the whole batch, moved by the last round's acceptance.

`AutoGamma` (`gamma="auto"`): each row's own draft length, every round, from the predicted
acceptance of its drafts (drafts/confidence.py) and the measured cost of a round
(eval/cost_model.py). The rule (docs/theory.md §2, "Draft length"): a row that has drafted
k tokens with predicted acceptances a_1..a_k has P_j = a_1·…·a_j (the chance that its first
j drafts are all accepted) and expects E(k) = 1 + Σ_{j≤k} P_j tokens from the round, which
costs T(k) = k·c + v(k). Drafting token k+1 adds P_{k+1} tokens and c + v(k+1) − v(k)
seconds, so it raises the row's tokens per second iff

    P_{k+1} · T(k) > E(k) · (c + v(k+1) − v(k)).

P_{k+1} is not known before token k+1 is drafted; the policy predicts it as P_k · â, with â
the row's recent acceptance (an exponential moving average of its verified drafts), which
is also its a_1 before the first draft (k = 0, E = 1, T = v(0)). A row for which even one
draft cannot pay proposes none, and when no row can, the round is a plain target step; a
target-only round pulls the row's estimate back towards 1, so that speculation is tried
again. The a_j are the drafter's predictions mapped through an online calibration
(eval/online_calibration.py). The batch drafts while any row still wants to and stops at
`max_gamma`; a row that stopped rides along in the draft's forward passes, but its later
tokens are not proposed (the verification is ragged: eval/verify.py).
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

from specdistill.drafts.confidence import acceptance_head
from specdistill.eval.cli_args import DEFAULT_GAMMA, DEFAULT_MAX_GAMMA
from specdistill.eval.cost_model import CostModel, CostTable, measure_verify
from specdistill.eval.online_calibration import Calibration


@runtime_checkable
class RoundLengths(Protocol):
    """One round's per-row drafting (a `drafts.types.DraftControl`): the most steps the
    batch may draft, and afterwards each row's proposed length."""

    max_steps: int
    lengths: list[int]  # drafts each row proposes (final once `keep_drafting` said False)
    limited: bool  # some row was cut by its length limit, not by the rule

    def keep_drafting(self, step: int, confidence: torch.Tensor) -> bool: ...


@dataclass(frozen=True)
class RoundPlan:
    """One round's drafting as a `LengthPolicy` plans it: `steps` draft steps (0: a plain
    target step). A policy of one γ for all rows sets `shortened` when it lowered γ because
    no row needs more tokens; a per-row policy hands the `control` that ends each row's
    drafting, or, for a target-only round, every row's `lengths` (0)."""

    steps: int
    shortened: bool = False
    control: RoundLengths | None = None
    lengths: list[int] | None = None

    def proposed(self) -> list[int] | None:
        """Drafts each row proposed (None: `steps` each), read once the drafts are made."""
        return list(self.control.lengths) if self.control is not None else self.lengths

    def limited(self) -> bool:
        """Whether a row drafted less than the policy chose because of the tokens it may
        still generate, read once the drafts are made."""
        return self.control.limited if self.control is not None else self.shortened


@runtime_checkable
class LengthPolicy(Protocol):
    """What the batch asks of a draft-length policy, round after round."""

    max_gamma: int  # the most drafts a row proposes in a round

    def prepare(self, target, draft, vocab_size: int, batch_size: int) -> None:
        """Start-up, before the first round (e.g. measure the costs)."""
        ...

    def plan_round(
        self, remaining: Sequence[int], estimates: Sequence[float], shorten: bool
    ) -> RoundPlan:
        """The round's drafting, for rows that may still generate remaining[i] tokens and
        whose acceptance estimates are `estimates`; `shorten`: no row drafts beyond what it
        may still generate."""
        ...

    def observe(self, batch_size: int, drafted: int, verify_s: float) -> None:
        """A round drafted `drafted` steps and its verification took `verify_s`."""
        ...

    def after_row(
        self, estimate: float, drafted: int, accepted: int, confidence: list[float] | None
    ) -> float:
        """A row's verified round (its drafts' raw predictions `confidence`): learn from
        it, and return the row's new acceptance estimate."""
        ...

    def after_round(self, accepted: Sequence[int], drafted: int, shortened: bool) -> None:
        """The round's accepted drafts per row, once every row has taken its tokens."""
        ...

    def cost_summary(self) -> dict | None:
        """The cost model the policy measured (`CostModel.summary`), if it keeps one."""
        ...


class UniformLength:
    """The base of the policies that give every row of a round the same γ (`gamma`):
    nothing to prepare, nothing learnt per row."""

    gamma: int

    def prepare(self, target, draft, vocab_size: int, batch_size: int) -> None:
        pass

    def plan_round(
        self, remaining: Sequence[int], estimates: Sequence[float], shorten: bool
    ) -> RoundPlan:
        """γ, shortened so that no row drafts beyond its last token when `shorten` (without
        it each row's random draws do not depend on the other rows: per-request seeds)."""
        most = max(remaining) - 1
        if shorten and self.gamma > most:
            return RoundPlan(most, shortened=True)
        return RoundPlan(self.gamma)

    def observe(self, batch_size: int, drafted: int, verify_s: float) -> None:
        pass

    def after_row(
        self, estimate: float, drafted: int, accepted: int, confidence: list[float] | None
    ) -> float:
        return estimate

    def after_round(self, accepted: Sequence[int], drafted: int, shortened: bool) -> None:
        pass

    def cost_summary(self) -> dict | None:
        return None


@dataclass
class FixedGamma(UniformLength):
    """γ drafts per row and round; γ = 0 decodes with the target alone."""

    gamma: int = DEFAULT_GAMMA

    def __post_init__(self):
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or self.gamma < 0:
            raise ValueError(f"gamma must be an integer ≥ 0, got {self.gamma!r}")

    @property
    def max_gamma(self) -> int:
        return self.gamma


@dataclass
class AdaptiveGamma(UniformLength):
    """Batch-level γ policy: lengthen after high-acceptance rounds, shorten after rejections.

    After each round, with f = mean accepted fraction over the batch's rows: f == 1 (every
    draft of every row accepted) -> γ + `up`; f < `low` -> γ − 1; bounded to [min_gamma, max_gamma].
    """

    start: int = 4
    min_gamma: int = 1
    max_gamma: int = 12
    up: int = 2
    low: float = 0.5
    gamma: int = field(init=False)

    def __post_init__(self):
        if not 1 <= self.min_gamma <= self.start <= self.max_gamma:
            raise ValueError(
                f"adaptive γ needs 1 ≤ min_gamma ≤ start ≤ max_gamma, got "
                f"{self.min_gamma}, {self.start}, {self.max_gamma}"
            )
        self.gamma = self.start

    def update(self, n_accepted: Sequence[int], gamma: int) -> None:
        fraction = sum(n_accepted) / (len(n_accepted) * gamma)
        if fraction == 1.0:
            self.gamma = min(self.gamma + self.up, self.max_gamma)
        elif fraction < self.low:
            self.gamma = max(self.gamma - 1, self.min_gamma)

    def after_round(self, accepted: Sequence[int], drafted: int, shortened: bool) -> None:
        """A full round (drafted, not shortened) moves γ."""
        if drafted > 0 and not shortened:
            self.update(accepted, drafted)


# ----------------------------------------------------------------------------- per-row lengths


def worth_drafting(
    expected: float, predicted_next: float, draft_s: float, verify_s: Sequence[float], k: int
) -> bool:
    """Whether drafting token k+1 raises a row's expected tokens per second:
    P̂_{k+1} · (k·c + v(k)) > E(k) · (c + v(k+1) − v(k)) (module docstring), with
    c = `draft_s` and v = `verify_s`."""
    extra = draft_s + verify_s[k + 1] - verify_s[k]
    return predicted_next * (k * draft_s + verify_s[k]) > expected * extra


def update_estimate(estimate: float, drafted: int, accepted: int, weight: float) -> float:
    """A row's acceptance estimate after a round that proposed `drafted` drafts and saw
    `accepted` of them accepted: one EMA step per observed draft (accepted or the first
    rejection); a round without drafts moves it towards 1 instead."""
    if drafted == 0:
        return estimate + weight * (1.0 - estimate)
    for j in range(min(accepted + 1, drafted)):
        estimate += weight * (float(j < accepted) - estimate)
    return estimate


class PerRowLength:
    """The base of the policies that set each row's own length per round (`AutoGamma`, a
    test's stub): `plan` makes the round's `RoundLengths` control from the most drafts each
    row may propose."""

    max_gamma: int

    def plan(self, limits: Sequence[int], estimates: Sequence[float]) -> RoundLengths | None:
        """A round's control for rows that may draft at most limits[i] tokens (estimates:
        their acceptance estimates); None: a target-only round."""
        raise NotImplementedError

    def plan_round(
        self, remaining: Sequence[int], estimates: Sequence[float], shorten: bool
    ) -> RoundPlan:
        most = self.max_gamma
        limits = [min(most, r - 1) if shorten else most for r in remaining]
        control = self.plan(limits, estimates)
        if control is None:
            return RoundPlan(0, lengths=[0] * len(limits))
        return RoundPlan(control.max_steps, control=control)

    def after_round(self, accepted: Sequence[int], drafted: int, shortened: bool) -> None:
        pass

    def cost_summary(self) -> dict | None:
        return None


class CostRule:
    """One round under `AutoGamma`: each row drafts while `worth_drafting` says so, with
    its drafts' predictions through `calibrate`."""

    def __init__(
        self,
        table: CostTable,
        limits: list[int],
        on_step,
        max_gamma: int,
        calibrate,
        estimates: Sequence[float],
    ):
        self.draft_s, self.verify_s = table.draft_s or 0.0, table.fitted()
        self.limits, self.on_step, self.calibrate = limits, on_step, calibrate
        self.estimates = list(estimates)  # per row: the next draft's predicted acceptance
        self.max_gamma, self.max_steps = max_gamma, max(limits)
        self.lengths = [0] * len(limits)
        self.active = [limit > 0 for limit in limits]
        self.product = [1.0] * len(limits)  # P_k
        self.expected = [1.0] * len(limits)  # E(k)
        self.limited = False
        self.clock = time.perf_counter()

    def keep_drafting(self, step: int, confidence: torch.Tensor) -> bool:
        values = confidence.tolist()
        now = time.perf_counter()
        self.on_step(now - self.clock)
        for i, raw in enumerate(values):
            if not self.active[i]:
                continue
            a = self.calibrate(raw)
            self.product[i] *= a
            self.expected[i] += self.product[i]
            self.lengths[i] = step
            go_on = step < self.max_gamma and worth_drafting(
                self.expected[i],
                self.product[i] * self.estimates[i],
                self.draft_s,
                self.verify_s,
                step,
            )
            if go_on and step >= self.limits[i]:
                self.limited = True  # cut by the row's own limit, not by the rule
            self.active[i] = go_on and step < self.limits[i]
        self.clock = time.perf_counter()
        return step < self.max_steps and any(self.active)


@dataclass
class AutoGamma(PerRowLength):
    """`gamma="auto"`: per-row draft lengths from predicted acceptance and measured costs
    (module docstring), at most `max_gamma`. `weight`: EMA weight of the cost model and of
    the rows' acceptance estimates; `repeats`: timed forwards per start-up measurement;
    `calibrate`: map the drafter's predictions through an online `Calibration`
    (eval/online_calibration.py); `batch_sizes`: further batch sizes whose costs start-up
    measures too (a size met later without a table starts from the nearest one's, which can
    be far off: v(k) grows with k much faster at 16 rows than at 1). Holds the run's cost
    model (`cost`) once prepared."""

    max_gamma: int = DEFAULT_MAX_GAMMA
    weight: float = 0.1
    repeats: int = 3
    calibrate: bool = True
    batch_sizes: tuple[int, ...] = ()
    cost: CostModel | None = field(default=None, init=False)
    calibration: Calibration = field(default_factory=Calibration, init=False)

    def __post_init__(self):
        if self.max_gamma < 1:
            raise ValueError(f"max_gamma must be ≥ 1, got {self.max_gamma}")

    def for_draft(self, draft) -> None:
        """Calibrate as `draft`'s predictions need (eval/online_calibration.py): an
        acceptance head's are probabilities, kept with their per-bin bias corrected; the
        proxy's are mapped to measured acceptance."""
        self.calibration = Calibration(head=acceptance_head(draft) is not None)

    def prepare(self, target, draft, vocab_size: int, batch_size: int) -> None:
        """Calibrate for `draft` (`for_draft`), then measure v(k) at `batch_size` and at
        each of `batch_sizes` (a few timed target forwards each)."""
        self.for_draft(draft)
        self.measure(target, vocab_size, batch_size)

    def measure(self, target, vocab_size: int, batch_size: int) -> None:
        """The start-up cost model: v(k) at `batch_size` and at each of `batch_sizes`."""

        def measure(b: int) -> list[float]:
            return measure_verify(target, vocab_size, b, self.max_gamma, repeats=self.repeats)

        self.cost = CostModel(self.max_gamma, measure, weight=self.weight)
        self.cost.measured(batch_size)
        for b in self.batch_sizes:
            self.cost.measured(b)

    def plan(self, limits: Sequence[int], estimates: Sequence[float]) -> CostRule | None:
        b = len(limits)
        table = self.cost.table(b)
        c, v = table.draft_s or 0.0, table.fitted()
        limits = [
            min(limit, self.max_gamma) if limit > 0 and worth_drafting(1.0, e, c, v, 0) else 0
            for limit, e in zip(limits, estimates, strict=True)
        ]
        if max(limits) == 0:
            return None
        calibrate = self.calibration if self.calibrate else float
        return CostRule(
            table,
            limits,
            lambda s: self.cost.observe_draft(b, s),
            self.max_gamma,
            calibrate,
            estimates,
        )

    def observe(self, batch_size: int, drafted: int, verify_s: float) -> None:
        self.cost.observe_verify(batch_size, drafted, verify_s)

    def after_row(
        self, estimate: float, drafted: int, accepted: int, confidence: list[float] | None
    ) -> float:
        if confidence is not None and drafted > 0:
            self.calibration.observe(confidence, drafted, accepted)
        return update_estimate(estimate, drafted, accepted, self.weight)

    def cost_summary(self) -> dict | None:
        return self.cost.summary() if self.cost is not None else None


def length_policy(
    gamma: int | str | LengthPolicy,
    max_gamma: int = DEFAULT_MAX_GAMMA,
    batch_sizes: tuple[int, ...] = (),
) -> LengthPolicy:
    """The policy of a draft decoding at `gamma`: "auto" -> a fresh `AutoGamma` of at most
    `max_gamma` drafts (measuring its costs at `batch_sizes` too), an integer >= 1 -> a
    `FixedGamma`, a `LengthPolicy` as given."""
    if gamma == "auto":
        return AutoGamma(max_gamma=max_gamma, batch_sizes=batch_sizes)
    if isinstance(gamma, LengthPolicy):
        return gamma
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f'gamma must be an integer ≥ 1, "auto" or a policy, got {gamma!r}')
    return FixedGamma(gamma)


@dataclass(frozen=True)
class GammaSetting:
    """A command line's --gamma and --max-gamma, turned into a fresh policy for each draft
    it decodes with (`policy`). `gamma`: drafts per round, "auto", or None: "auto" for a
    draft that carries an acceptance head, `DEFAULT_GAMMA` otherwise."""

    gamma: int | Literal["auto"] | None = None
    max_gamma: int = DEFAULT_MAX_GAMMA

    def policy(self, draft, capacity: int = 1) -> LengthPolicy:
        """The policy of an engine of `capacity` rows decoding with `draft` (None: the
        target alone, γ = 0). Under "auto" its costs are measured at start-up at `capacity`
        rows and at every power of two below it, the batch sizes a server goes through as
        its load changes."""
        if draft is None:
            return FixedGamma(0)
        gamma = self.gamma
        if gamma is None:
            gamma = "auto" if acceptance_head(draft) is not None else DEFAULT_GAMMA
        sizes = tuple(1 << i for i in range(capacity.bit_length()) if 1 << i < capacity)
        return length_policy(gamma, self.max_gamma, sizes)

    @property
    def most_drafts(self) -> int:
        """The most drafts a row may propose in a round: `max_gamma`, or a larger fixed γ."""
        return max(self.max_gamma, self.gamma if isinstance(self.gamma, int) else 0)
