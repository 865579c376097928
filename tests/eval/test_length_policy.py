"""Per-row draft lengths (`gamma="auto"`): ragged verification stays lossless (greedy equality,
chi-square at T = 1), target-only rounds in between, the cost rule on hand-computed costs, the
confidence proxy, the calibration, the statistics and the sweep's "auto" entry."""

import pytest
import torch

from specdistill.drafts.confidence import predicted_acceptance
from specdistill.drafts.eagle3.head import Eagle3Head
from specdistill.drafts.standalone import StandaloneDrafter
from specdistill.eval import engine, verify
from specdistill.eval.cli_args import parse_gamma
from specdistill.eval.cost_model import CostModel, CostTable
from specdistill.eval.length_policy import (
    AutoGamma,
    CostRule,
    FixedGamma,
    LengthPolicy,
    PerRowLength,
    RoundPlan,
    length_policy,
    update_estimate,
    worth_drafting,
)
from specdistill.eval.online_calibration import Calibration
from specdistill.eval.report import SpeculateReport
from specdistill.eval.round_stats import SpecStats
from specdistill.eval.speculative import _gammas
from specdistill.eval.sweep import Settings, sweep
from tests.eval.helpers import N_NEW, N_SAMPLES, PREFIX, chi_square_pvalue, joint_first_two

# ----------------------------------------------------------------------------- a stub policy


class FixedRound:
    """A round's control that stops row i after lengths[i] drafts."""

    def __init__(self, lengths: list[int]):
        self.lengths, self.limited = lengths, False
        self.max_steps = max(lengths)
        self.steps = 0

    def keep_drafting(self, step: int, confidence: torch.Tensor) -> bool:
        assert confidence.shape == (len(self.lengths),)
        self.steps = step
        return step < self.max_steps


class FixedLengths(PerRowLength):
    """A `LengthPolicy` whose rows propose pattern[row % len] drafts (within their limits);
    every `off`-th round (when set) is a target-only round."""

    max_gamma = 8

    def __init__(self, pattern: list[int], off: int | None = None):
        self.pattern, self.off, self.rounds = pattern, off, 0

    def prepare(self, target, draft, vocab_size, batch_size):
        pass

    def plan(self, limits, estimates):
        self.rounds += 1
        if self.off and self.rounds % self.off == 0:
            return None
        lengths = [min(self.pattern[i % len(self.pattern)], m) for i, m in enumerate(limits)]
        return FixedRound(lengths) if max(lengths) > 0 else None

    def observe(self, batch_size, drafted, verify_s):
        pass

    def after_row(self, estimate, drafted, accepted, confidence):
        return estimate


def test_every_policy_is_a_length_policy():
    for policy in (FixedLengths([1]), AutoGamma(), engine.AdaptiveGamma(), FixedGamma(3)):
        assert isinstance(policy, LengthPolicy)
    assert not isinstance(3, LengthPolicy)


def test_one_construction_of_a_policy():
    assert length_policy(3) == FixedGamma(3)
    auto = length_policy("auto", max_gamma=5, batch_sizes=(1, 2))
    assert isinstance(auto, AutoGamma) and auto.max_gamma == 5 and auto.batch_sizes == (1, 2)
    stub = FixedLengths([1])
    assert length_policy(stub) is stub
    for bad in (0, -1, True, 2.5, "fast"):
        with pytest.raises(ValueError, match="gamma must be"):
            length_policy(bad)
    assert parse_gamma("3") == 3 and parse_gamma("auto") == "auto" and parse_gamma(2.0) == 2
    for bad in ("0", "2.5", 2.5, True, None):
        with pytest.raises(ValueError, match="integer >= 1 or 'auto'"):
            parse_gamma(bad)


def test_round_plans():
    """One γ for all rows: shortened only when asked and no row needs γ + 1 tokens; a
    per-row policy's target-only round proposes 0 drafts in every row."""
    assert FixedGamma(4).plan_round([3, 2], [1.0, 1.0], shorten=True) == RoundPlan(2, True)
    assert FixedGamma(4).plan_round([3, 2], [1.0, 1.0], shorten=False) == RoundPlan(4)
    assert FixedGamma(2).plan_round([9], [1.0], shorten=True) == RoundPlan(2)
    idle = FixedLengths([0]).plan_round([5, 5], [1.0, 1.0], shorten=True)
    assert idle.steps == 0 and idle.proposed() == [0, 0] and not idle.limited()
    ragged = FixedLengths([3, 1]).plan_round([9, 9], [1.0, 1.0], shorten=True)
    assert ragged.steps == 3 and ragged.proposed() == [3, 1]


# ----------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("batch_size", [1, 2, 5])
@pytest.mark.parametrize("pattern, off", [([3, 1, 0, 2, 5], None), ([2, 4, 1], 3)])
def test_greedy_equals_target_with_ragged_rows(
    perturbed_pair, prompts, references, batch_size, pattern, off
):
    policy = FixedLengths(pattern, off)
    out = engine.generate(
        *perturbed_pair, prompts, gamma=policy, max_new_tokens=N_NEW, batch_size=batch_size
    )
    assert out.sequences == references
    spec = [r for r in out.rounds if r.gamma > 0]
    assert all(n <= k for r in spec for n, k in zip(r.accepted, r.drafted, strict=True))
    if batch_size > 1:
        assert any(len(set(r.drafted)) > 1 for r in spec)  # rows of different lengths
    if off:
        assert any(r.gamma == 0 and len(r.requests) > 0 for r in out.rounds)


def test_auto_greedy_equals_target(perturbed_pair, prompts, references):
    out = engine.generate(
        *perturbed_pair, prompts, gamma="auto", max_new_tokens=N_NEW, batch_size=2
    )
    assert out.sequences == references
    assert "2" in out.cost and out.cost["2"]["draft_s"] > 0
    histogram = out.stats[0].length_dict()["drafted_length_histogram"]
    assert sum(histogram) > 0


def test_engine_with_ragged_rows_and_target_only_rounds(perturbed_pair, prompts, references):
    e = engine.Engine(*perturbed_pair, gamma=FixedLengths([2, 0, 3], off=4), capacity=3)
    ids = [e.add(p, max_new_tokens=N_NEW) for p in prompts]
    got: dict[int, list[int]] = {}
    while e.busy:
        for u in e.step():
            got.setdefault(u.request, []).extend(u.tokens)
    assert [got[r] for r in ids] == references


def test_eagle3_head_through_target_only_rounds(perturbed_pair, prompts):
    target = perturbed_pair[0]
    head = Eagle3Head.from_target(target, aux_layers=[0, 1], draft_vocab_size=96).eval()
    expected = engine.generate(target, None, prompts, max_new_tokens=12).sequences
    for policy in (FixedLengths([2, 1, 0], off=2), "auto"):
        out = engine.generate(target, head, prompts, gamma=policy, max_new_tokens=12, batch_size=2)
        assert out.sequences == expected


def test_sampling_with_ragged_rows_is_lossless(small_perturbed_pair):
    """Rows of one batch propose 0..3 drafts: each row's output is still the target's."""
    out = engine.generate(
        *small_perturbed_pair,
        [PREFIX] * N_SAMPLES,
        gamma=FixedLengths([0, 1, 2, 3]),
        temperature=1.0,
        max_new_tokens=4,
    )
    first = out.rounds[0]
    assert sorted(set(first.drafted)) == [0, 1, 2, 3]
    for k in (1, 3):  # rejections (residual) and full acceptance (bonus) both happen
        accepted = [n for n, d in zip(first.accepted, first.drafted, strict=True) if d == k]
        assert 0.1 < sum(n < k for n in accepted) / len(accepted) < 0.9
    expected = joint_first_two(small_perturbed_pair[0], 1.0, None, None)
    assert chi_square_pvalue(out.sequences, expected) > 1e-3


def test_per_request_sampling_with_ragged_rows_is_lossless(small_perturbed_pair):
    """The server's engine: each row samples with its own generator, verified on its own
    proposed drafts only."""
    e = engine.Engine(*small_perturbed_pair, gamma=FixedLengths([0, 1, 2, 3]), capacity=3000)
    ids = [
        e.add(PREFIX, max_new_tokens=4, sampling=engine.Sampling(1.0, seed=i)) for i in range(6000)
    ]
    got: dict[int, list[int]] = {}
    while e.busy:
        for u in e.step():
            got.setdefault(u.request, []).extend(u.tokens)
    expected = joint_first_two(small_perturbed_pair[0], 1.0, None, None)
    assert chi_square_pvalue([got[r] for r in ids], expected) > 1e-3


def test_chi_square_catches_a_residual_past_a_rows_last_draft(small_perturbed_pair, monkeypatch):
    """A row that proposed all of its k drafts must take its next token from p, not from the
    residual against the draft it did not propose."""

    def no_bonus(p, q, drafts, generator, lengths=None):
        batch, gamma = drafts.shape
        p_draft = p[:, :gamma].gather(-1, drafts[..., None]).squeeze(-1)
        q_draft = q.gather(-1, drafts[..., None]).squeeze(-1)
        accept = torch.rand(batch, gamma, generator=generator) * q_draft < p_draft
        if lengths is not None:
            accept &= torch.arange(gamma)[None, :] < lengths[:, None]
        n = accept.long().cumprod(1).sum(1)
        q_padded = torch.cat([q, q.new_zeros(batch, 1, q.shape[-1])], dim=1)
        rows = torch.arange(batch)
        return n, verify.draw(verify.residual(p[rows, n], q_padded[rows, n]), generator)

    monkeypatch.setattr(verify, "verify_sampled", no_bonus)
    out = engine.generate(
        *small_perturbed_pair,
        [PREFIX] * N_SAMPLES,
        gamma=FixedLengths([1, 3]),
        temperature=1.0,
        max_new_tokens=4,
    )
    assert (
        chi_square_pvalue(out.sequences, joint_first_two(small_perturbed_pair[0], 1.0, None, None))
        < 1e-6
    )


def test_verify_with_lengths():
    logits = torch.tensor([[[0.0, 5.0], [5.0, 0.0], [0.0, 5.0]]] * 2)  # argmax 1, 0, 1
    drafts = torch.tensor([[1, 0], [1, 0]])
    n, nxt = verify.verify_greedy(logits, drafts, torch.tensor([2, 1]))
    assert n.tolist() == [2, 1] and nxt.tolist() == [1, 0]
    # Slot 1 is sure to be accepted; slot 2 was not proposed: the next token comes from
    # p_2 = (.5, .5), not from the residual against q_2 (which would always give token 0).
    p = torch.tensor([[[0.0, 1.0], [0.5, 0.5], [1.0, 0.0]]] * 200)
    q = torch.tensor([[[0.0, 1.0], [0.0, 1.0]]] * 200)
    g = torch.Generator().manual_seed(0)
    drafts = torch.tensor([[1, 1]] * 200)
    n, nxt = verify.verify_sampled(p, q, drafts, g, torch.full((200,), 1))
    assert n.tolist() == [1] * 200 and 50 < int(nxt.sum()) < 150


# ----------------------------------------------------------------------------- the cost rule


def test_the_threshold_rule_on_hand_computed_costs():
    c, v = 1.0, [10.0 + 0.5 * k for k in range(9)]
    # k = 0: E = 1, T = 10, one more draft costs 1 + 0.5: worth it iff P̂_1 · 10 > 1.5.
    assert worth_drafting(1.0, 0.16, c, v, 0) and not worth_drafting(1.0, 0.14, c, v, 0)
    table = CostTable(v, draft_s=c)
    rule = CostRule(table, [8, 8, 1], lambda s: None, 8, float, [0.5, 0.2, 0.9])
    # Next drafts predicted at the rows' estimates (.5, .2, .9), the confidences given raw.
    # Row 0 (a = 0.5): step 1 P = .5, E = 1.5, P̂_2 = .25: .25·11.5 = 2.875 > 1.5·1.5 -> on;
    # step 2 P = .25, E = 1.75, P̂_3 = .125: .125·13 = 1.625 < 1.75·1.5 -> stops at 2.
    # Row 1 (a = 0.2): P̂_2 = .04: .46 < 1.2·1.5 -> stops at 1. Row 2: its limit is 1.
    assert rule.keep_drafting(1, torch.tensor([0.5, 0.2, 0.9]))
    assert rule.lengths == [1, 1, 1] and rule.limited  # row 2 wanted more
    assert not rule.keep_drafting(2, torch.tensor([0.5, 0.9, 0.9]))
    assert rule.lengths == [2, 1, 1]


def test_auto_plans_target_only_rounds_when_no_draft_pays():
    policy = AutoGamma(max_gamma=4)
    policy.cost = CostModel(4, lambda b: [10.0 + 0.5 * k for k in range(5)])
    policy.cost.measured(2)
    policy.cost.observe_draft(2, 1.0)
    assert policy.plan([4, 4], [0.1, 0.12]) is None
    rule = policy.plan([4, 0], [0.9, 0.9])
    assert rule.max_steps == 4 and rule.limits == [4, 0]
    assert rule.lengths == [0, 0]


def test_cost_model_tables_and_smoothing():
    calls = []
    model = CostModel(2, lambda b: calls.append(b) or [3.0, 1.0, 5.0], weight=0.5)
    t = model.table(4)
    assert calls == [4] and t.fitted() == pytest.approx([2.0, 3.0, 4.0])
    assert CostTable([3.0, 2.0, 1.0]).fitted() == pytest.approx([2.0, 2.0, 2.0])  # slope ≥ 0
    model.observe_verify(4, 1, 3.0)
    assert t.verify_s == [6.0, 2.0, 10.0]  # v(1)'s EMA step scales the whole table
    model.observe_draft(4, 0.4)
    model.observe_draft(4, 0.2)
    assert t.draft_s == pytest.approx(0.3)
    assert model.table(1).verify_s == t.verify_s and calls == [4]  # copied, not measured
    assert set(model.summary()) == {"1", "4"}


def test_estimates_and_calibration():
    assert update_estimate(0.5, 0, 0, 0.5) == 0.75  # a target-only round: towards 1
    assert update_estimate(0.5, 3, 1, 0.5) == 0.375  # one accept (.75), one reject (.375)
    cal = Calibration(bins=4, prior=2.0)
    assert cal(0.3) == 0.5
    for _ in range(50):
        cal.observe([0.02, 0.9], 2, 1)  # 0.02 accepted, 0.9 rejected
    assert cal(0.02) > 0.9 and cal(0.9) < 0.1
    assert 0 <= cal(1e-9) <= 1


def test_a_heads_calibration_keeps_its_predictions_apart():
    cal = Calibration(bins=4, prior=2.0, head=True)
    assert cal(0.62) == 0.62 and cal(0.9) == 0.9  # a head's probability passes at first
    for _ in range(50):  # predicted 0.7, accepted half the time: a bias of −0.2 in its bin
        cal.observe([0.7], 1, 1)
        cal.observe([0.7, 0.9], 2, 0)
    assert cal(0.55) == pytest.approx(0.35, abs=0.01)
    assert cal(0.74) - cal(0.55) == pytest.approx(0.19)  # the spread within a bin is kept
    assert cal(0.95) < 0.95  # an empty bin moves by the pooled bias
    assert 0 <= cal(0.0) <= cal(1.0) <= 1


# ----------------------------------------------------------------------------- the confidences


def test_confidence_proxy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 10, generator=g) * 3
    tokens = logits.argmax(-1)
    greedy = predicted_acceptance(None, logits, tokens)
    assert torch.allclose(greedy, logits.softmax(-1).max(-1).values)
    q = (logits / 0.5).softmax(-1)
    q[1] = 0  # a greedy row of a mixed batch
    mixed = predicted_acceptance(None, logits, tokens, q)
    assert mixed[1] == greedy[1] and mixed[0] == q[0, tokens[0]]
    assert ((mixed >= 0) & (mixed <= 1)).all()


def test_drafter_gives_confidences_and_uses_an_acceptance_head(perturbed_pair):
    draft = perturbed_pair[1]
    drafter = StandaloneDrafter(draft, 96, torch.device("cpu"))
    drafter.admit([[1, 2, 3], [4, 5]])

    def greedy(logits):
        return logits.argmax(-1), None

    control = FixedRound([2, 3])
    proposal = drafter.propose(5, greedy, control)
    assert proposal.tokens.shape == (2, 3) and control.steps == 3
    assert ((proposal.confidence > 0) & (proposal.confidence <= 1)).all()
    assert drafter.propose(2, greedy).confidence is None  # none asked for

    from specdistill.drafts.acceptance_head import AcceptanceHead, AcceptanceHeadConfig, attach_head

    # An untrained head predicts its prior everywhere (its last layer starts at zero weight).
    attach_head(draft, AcceptanceHead(AcceptanceHeadConfig.for_draft(draft, prior=0.7)))
    try:
        drafter = StandaloneDrafter(draft, 96, torch.device("cpu"))
        drafter.admit([[1, 2, 3]])
        proposal = drafter.propose(2, greedy, FixedRound([2]))
    finally:
        attach_head(draft, None)
    assert torch.allclose(proposal.confidence, torch.tensor(0.7).expand(1, 2))


# ----------------------------------------------------------------------------- statistics, sweep


def test_spec_stats_lengths():
    s = SpecStats()
    s.record(0, 0)
    s.record(3, 1, [0.5, 0.25, 0.9])  # reached: draft 1 (accepted), draft 2 (rejected)
    s.record(2, 2, [1.0, 1.0])
    d = s.length_dict()
    assert d["drafted_length_histogram"] == [1, 0, 1, 1]
    assert d["mean_drafted_length"] == pytest.approx(5 / 3)
    assert d["mean_predicted_acceptance"] == pytest.approx(2.75 / 4)
    assert d["mean_realised_acceptance"] == pytest.approx(3 / 4)
    assert s.as_dict()["num_spec_steps"] == 2 and s.as_dict()["num_draft_tokens"] == 5


def test_auto_in_a_sweep(perturbed_pair, prompts):
    settings = Settings(gammas=[2, "auto"], temperatures=(0.0,), max_new_tokens=8, max_gamma=3)
    result, runs = sweep(*perturbed_pair, prompts[:2], settings)
    auto = [e for e in result["configs"] if e["gamma"] == "auto"]
    assert len(auto) == 1 and auto[0]["name"] == "T=0 auto"
    assert result["best_gamma"]["0"]["measured"] == 2  # auto is not a fixed γ
    assert sum(auto[0]["drafted_length_histogram"]) > 0
    assert len(auto[0]["drafted_length_histogram"]) <= 4
    assert set(auto[0]["cost_model"]["1"]) == {"draft_s", "verify_s"}
    report = SpeculateReport.of(result)
    assert '"gamma": "auto"' in report.to_json()
    fixed = next(e for e in report.model_dump(exclude_unset=True)["configs"] if e["gamma"] == 2)
    assert "drafted_length_histogram" not in fixed


def test_gamma_argument():
    assert _gammas("1,auto, 3") == [1, "auto", 3]
    with pytest.raises(Exception, match="integer >= 1"):
        _gammas("0,auto")
    with pytest.raises(ValueError, match="gammas"):
        Settings(gammas=[0])
    with pytest.raises(ValueError, match="max_gamma"):
        AutoGamma(max_gamma=0)
