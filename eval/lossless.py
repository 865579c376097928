"""Greedy losslessness under rounding: is a divergence from the target alone a near-tie of its
argmax, or a real error?

At T=0 a speculative output must equal the target alone's, token for token. In floating
point it may not quite: the verification pass scores γ + 1 positions in one forward, the
target alone one, the two sum in different orders, and where the target's two best logits
lie within rounding of each other either can come out on top ("lossless up to the precision
limits of hardware numerics", as vLLM puts it). `GreedyChecker.check` finds each prompt's
first divergence (`first_divergence`), scores that position again with a copy of the target
in a higher precision (`reference_dtype`), run once over the prompt and the common prefix,
and `classify` tells the two cases apart.

The bound. With l the reference logits there, a the target alone's token, b the speculative
run's and top = max l, the divergence is a near-tie when both tokens are within rounding of
the top:

    top − min(l_a, l_b) ≤ ULPS · eps(run dtype) · max(|top|, |l_a|, |l_b|, 1)

eps · |l| is the spacing of the run dtype's numbers at the logits' magnitude (one to two
units in the last place). A pass computes the gap between two logits with an error e, and
two passes disagree on the argmax only where the true gap is below one pass's |e|. Measured
on the embedded code-deep target (20 layers, CPU, 1854 positions of 12 HumanEval prompts,
one pass and token-by-token decoding against float64), |e| of the top two tokens reached 7.6
eps·|l| in float32 and 1.6 in bfloat16: ULPS = 8 covers both (at |l| = 10 a logit gap of
about 1e-5 in float32, 0.6 in bfloat16). Deeper and wider
models accumulate more rounding: a real error whose gap is a few tolerances is worth reading
in report.json before calling it a bug. Anything above the bound is a real error.
"""

import copy
from dataclasses import dataclass, field
from typing import Literal

import torch

ULPS = 8  # the near-tie bound in units of eps(run dtype) · |logit| (see above)

Kind = Literal["near_tie", "real_error"]


@dataclass
class Verdict:
    """`classify`'s answer: `gap` = top − min(l_a, l_b) in the reference logits, `tolerance`
    its bound for the run's dtype, `near_tie` = gap ≤ tolerance."""

    near_tie: bool
    gap: float
    tolerance: float


def reference_dtype(run_dtype: torch.dtype) -> torch.dtype:
    """The precision a divergence is scored again in: float64 for a float32 (or float64) run,
    float32 for a half-precision one (its rounding is then ~65000 times below the run's)."""
    return torch.float64 if torch.finfo(run_dtype).bits >= 32 else torch.float32


def classify(
    logits: torch.Tensor,
    target_token: int,
    speculative_token: int,
    run_dtype: torch.dtype,
    ulps: float = ULPS,
) -> Verdict:
    """Whether a greedy divergence is a near-tie: both tokens' reference `logits` (one
    position, [V]) within `ulps` · eps(`run_dtype`) · magnitude of the top logit, so that
    either could be the argmax of a run in `run_dtype` (the module's docstring)."""
    row = logits.detach().double().flatten()
    top = float(row.max())
    la, lb = float(row[target_token]), float(row[speculative_token])
    scale = max(abs(top), abs(la), abs(lb), 1.0)
    tolerance = ulps * torch.finfo(run_dtype).eps * scale
    gap = top - min(la, lb)
    return Verdict(gap <= tolerance, gap, tolerance)


def first_divergence(expected: list[int], got: list[int]) -> int | None:
    """The first position where `got` differs from `expected` (the shorter one's length when
    one is a prefix of the other), or None when they are equal."""
    for i, (x, y) in enumerate(zip(expected, got, strict=False)):
        if x != y:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


@dataclass
class Divergence:
    """A prompt's first difference from the target alone: its index in the prompt set, the
    generated-token position, both tokens (None: that output ended there), and `classify`'s
    gap and tolerance in the reference precision (None when a token is missing: an output
    that stops short is a real error)."""

    prompt: int
    position: int
    target_token: int | None
    speculative_token: int | None
    gap: float | None
    tolerance: float | None
    kind: Kind


@dataclass
class GreedyCheck:
    """One T=0 configuration against the target alone: `identical` of `prompts` outputs equal
    it token for token (`exact_match_rate`), the rest diverge at `near_ties` or `real_errors`
    (each in `divergences`); the run's dtype, the reference dtype and the bound's `ulps`."""

    prompts: int
    identical: int
    exact_match_rate: float
    near_ties: int
    real_errors: int
    run_dtype: str
    reference_dtype: str
    ulps: float
    divergences: list[Divergence] = field(default_factory=list)


class GreedyChecker:
    """Classifies the greedy divergences of a sweep's configurations (`check`) against one
    target. The high-precision copy of the target is made at the first divergence and kept
    for the next ones; drop the checker to free it."""

    def __init__(self, target, vocab_size: int, ulps: float = ULPS):
        self.target, self.vocab_size, self.ulps = target, vocab_size, ulps
        self.run_dtype = next(target.parameters()).dtype
        self.reference_dtype = reference_dtype(self.run_dtype)
        self._reference = None

    def check(
        self, prompt_ids: list[list[int]], expected: list[list[int]], got: list[list[int]]
    ) -> GreedyCheck:
        """`got` (a speculative run's outputs) against `expected` (the target alone's), per
        prompt of `prompt_ids`."""
        divergences = []
        for i, (prompt, want, have) in enumerate(zip(prompt_ids, expected, got, strict=True)):
            at = first_divergence(want, have)
            if at is not None:
                divergences.append(self._divergence(i, at, prompt, want, have))
        n, near = len(prompt_ids), sum(d.kind == "near_tie" for d in divergences)
        return GreedyCheck(
            prompts=n,
            identical=n - len(divergences),
            exact_match_rate=(n - len(divergences)) / n,
            near_ties=near,
            real_errors=len(divergences) - near,
            run_dtype=_name(self.run_dtype),
            reference_dtype=_name(self.reference_dtype),
            ulps=self.ulps,
            divergences=divergences,
        )

    def _divergence(self, i: int, at: int, prompt, want, have) -> Divergence:
        a = want[at] if at < len(want) else None
        b = have[at] if at < len(have) else None
        if a is None or b is None:
            return Divergence(i, at, a, b, None, None, "real_error")
        logits = self.logits(prompt + want[:at])
        v = classify(logits, a, b, self.run_dtype, self.ulps)
        return Divergence(
            i, at, a, b, v.gap, v.tolerance, "near_tie" if v.near_tie else "real_error"
        )

    def logits(self, ids: list[int]) -> torch.Tensor:
        """The reference copy's next-token logits after `ids` ([vocab_size], one forward)."""
        if self._reference is None:  # copied outside inference mode: ordinary parameters
            self._reference = copy.deepcopy(self.target).to(self.reference_dtype).eval()
        device = next(self._reference.parameters()).device
        with torch.inference_mode():
            out = self._reference(input_ids=torch.tensor([ids], device=device))
        return out.logits[0, -1, : self.vocab_size].double().cpu()


def markdown_lines(configs: list[dict]) -> list[str]:
    """report.md's section on the greedy check (eval/report.py): per T=0 configuration (the
    sweep's result entries) its exact matches and each divergence (prompt index @ token
    position), a near-tie or a real error, with its gap / tolerance."""
    checks = [(e["name"], e["greedy_check"]) for e in configs if e.get("greedy_check")]
    if not checks:
        return []
    first = checks[0][1]
    lines = [
        "",
        "## Greedy losslessness (T=0)",
        "",
        f"Each divergence from the target alone, scored again with the target in "
        f"{first['reference_dtype']}: a near-tie when both tokens' logits lie within "
        f"{first['ulps']:g}·eps({first['run_dtype']})·|logit| of the top one (gap ≤ tolerance), "
        "else a real error.",
        "",
    ]
    for name, c in checks:
        found = ", ".join(
            f"{d['prompt']}@{d['position']} {d['kind'].replace('_', ' ')}"
            + ("" if d["gap"] is None else f" ({d['gap']:.3g} / {d['tolerance']:.3g})")
            for d in c["divergences"]
        )
        lines.append(
            f"- {name}: {c['identical']}/{c['prompts']} identical; near-ties {c['near_ties']}, "
            f"real errors {c['real_errors']}" + (f"; {found}" if found else "")
        )
    return lines


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
