"""The final hidden state next to the logits (models/lean.py `with_hidden`, KVStream's
`hidden`): equal to transformers' `hidden_states[-1]`; a standalone drafter with an acceptance
head drafts on the lean forward and predicts the acceptances transformers' forward gives; when
an internal the lean forward reads is missing, transformers' forward still gives the hidden
state."""

import pytest
import torch

from specdistill.drafts.acceptance_head import AcceptanceHead, AcceptanceHeadConfig, attach_head
from specdistill.drafts.standalone import StandaloneDrafter
from specdistill.models import lean
from specdistill.models.kv_cache import length_groups
from tests.models.helpers import CHANGES, VOCAB, build

CPU = torch.device("cpu")
PROMPTS = [[5, 6, 7, 9, 11], [8, 3]]


def ragged_hidden(stream, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, hidden) of the valid kept positions through a ragged prefill, padded tokens and
    rolled-back tails (holes)."""
    out = []
    stream.admit([[5, 6, 7, 9], [8]])
    g = torch.Generator().manual_seed(seed)
    for k, valid_first in [(4, True), (1, True), (3, False), (1, False)]:
        tokens = torch.randint(0, VOCAB, (2, k), generator=g)
        valid = torch.ones(2, k, dtype=torch.bool)
        valid[1, 0] = valid_first
        logits = stream.forward(tokens, valid, keep=k, hidden=True)
        out.append((logits[valid], stream.hidden[valid]))
        stream.drop_last(torch.tensor([k - 1, 0]))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@torch.no_grad()
def test_lean_hidden_equals_transformers(family):
    from specdistill.models.kv_cache import KVStream

    model = build(family)
    fast, plain = KVStream(model, VOCAB, CPU), KVStream(model, VOCAB, CPU, lean=False)
    assert fast.lean is not None and plain.lean is None
    for (la, ha), (lb, hb) in zip(ragged_hidden(fast), ragged_hidden(plain), strict=True):
        assert ha.shape[-1] == model.config.hidden_size
        torch.testing.assert_close(ha, hb, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    # One row decoded token by token: each step's hidden state is the full forward's.
    ids = torch.tensor([[4, 9, 2, 7, 1, 30, 12]])
    reference = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
    stream = KVStream(model, VOCAB, CPU)
    stream.admit([ids[0, :3].tolist()])
    one = torch.ones(1, 1, dtype=torch.bool)
    for t in range(3, ids.shape[1]):
        stream.forward(ids[:, t : t + 1], one, keep=1, hidden=True)
        torch.testing.assert_close(stream.hidden[0, -1], reference[t], rtol=1e-5, atol=1e-5)
    stream.forward(ids[:, :1], one, keep=1)
    assert stream.hidden is None  # not asked for


def with_random_head(model) -> AcceptanceHead:
    torch.manual_seed(1)
    head = AcceptanceHead(AcceptanceHeadConfig.for_draft(model))
    with torch.no_grad():  # an untrained head predicts its prior everywhere
        torch.nn.init.normal_(head.fc2.weight)
    attach_head(model, head)
    return head


class Steps:
    """A round's control that keeps drafting every row for `steps` steps."""

    def __init__(self, steps: int):
        self.steps = steps

    def keep_drafting(self, step: int, confidence: torch.Tensor) -> bool:
        return step < self.steps


def greedy(logits):
    return logits.argmax(-1), None


def draft_rounds(drafter: StandaloneDrafter, rounds: int = 3, gamma: int = 4):
    """Proposals of a few rounds, with a partial acceptance in between (ragged caches)."""
    drafter.admit(PROMPTS)
    out = []
    for r in range(rounds):
        proposal = drafter.propose(gamma, greedy, Steps(gamma))
        out.append(proposal)
        n = torch.tensor([r % (gamma + 1), gamma])
        host = [[int(n_i), 1 + i, *proposal.tokens[i].tolist()] for i, n_i in enumerate(n)]
        drafter.commit(gamma, n, host)
    return out


class Refuse:
    def __call__(self, *args, **kwargs):
        raise AssertionError("transformers' forward ran")


@torch.no_grad()
def test_drafter_with_a_head_stays_lean_and_predicts_as_transformers(monkeypatch):
    model = build("llama")
    with_random_head(model)
    calls = []
    with_hidden = lean.LeanDecoder.with_hidden

    def counted(self, *args, **kwargs):
        calls.append(1)
        return with_hidden(self, *args, **kwargs)

    monkeypatch.setattr(lean.LeanDecoder, "with_hidden", counted)
    fast = StandaloneDrafter(model, VOCAB, CPU)
    assert fast.stream.lean is not None
    monkeypatch.setattr(model, "forward", Refuse())
    lean_rounds = draft_rounds(fast)
    monkeypatch.undo()
    # The prefills (one per group of similar length), then every draft step of 3 rounds of 4,
    # on the lean forward.
    prefills = len(length_groups([len(p) - 1 for p in PROMPTS]))
    assert len(calls) == prefills + 3 * 4 and fast.stream.output is None

    monkeypatch.setattr(lean, "enabled", False)
    plain = StandaloneDrafter(model, VOCAB, CPU)
    assert plain.stream.lean is None
    plain_rounds = draft_rounds(plain)
    for a, b in zip(lean_rounds, plain_rounds, strict=True):
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.confidence, b.confidence, rtol=1e-5, atol=1e-6)
    confidence = torch.cat([p.confidence.flatten() for p in lean_rounds])
    assert confidence.std() > 0.01  # the head's predictions vary with the hidden state
    attach_head(model, None)


@pytest.mark.parametrize("change", list(CHANGES))
@torch.no_grad()
def test_a_missing_internal_falls_back_with_the_hidden_state(change, monkeypatch):
    reference = build("llama")
    with_random_head(reference)
    expected = draft_rounds(StandaloneDrafter(reference, VOCAB, CPU))
    monkeypatch.setattr(lean, "_WARNED", set())
    model = build("llama")
    CHANGES[change](model, monkeypatch)
    with_random_head(model)
    drafter = StandaloneDrafter(model, VOCAB, CPU)
    assert drafter.stream.lean is None
    got = draft_rounds(drafter)
    assert drafter.stream.hidden is not None
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.confidence, b.confidence, rtol=1e-5, atol=1e-6)
