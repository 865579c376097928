"""The tree that carries every chain in one sequence (drafts/chains.py) gives each chain
position the logits the model gives that chain's own sequence, prefix + chain, run alone."""

import pytest
import torch

from specdistill.drafts.chains import prefix_groups, sample_chains
from specdistill.errors import UserError
from tests.helpers import make_model, make_tokenizer


@pytest.fixture(scope="module")
def tokenizer_draft_target():
    """(tokenizer, draft, target): two tiny random models of one tokenizer."""
    tok = make_tokenizer()
    draft = make_model(tok, hidden=32, layers=1, seed=1).eval()
    target = make_model(tok, hidden=48, layers=2, seed=2).eval()
    return tok, draft, target


def _batch(vocab: int, lengths: list[int]) -> dict:
    g = torch.Generator().manual_seed(0)
    n = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), n), generator=g)
    attention = torch.zeros(len(lengths), n, dtype=torch.long)
    for row, length in enumerate(lengths):
        attention[row, :length] = 1
        ids[row, length:] = 0
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": attention.bool()}


@pytest.mark.parametrize("hidden, attention", [(False, "sdpa"), (True, "sdpa"), (False, "eager")])
def test_each_chain_position_matches_its_own_sequence(tokenizer_draft_target, hidden, attention):
    tok, draft, target = tokenizer_draft_target
    for model in (draft, target):
        model.set_attn_implementation(attention)
    vocab = len(tok)
    batch = _batch(vocab, [14, 9])  # the second row is right-padded
    starts, gamma = [2, 5, 8, 11], 4
    g = torch.Generator().manual_seed(3)
    chains = sample_chains(
        draft,
        target,
        batch,
        starts,
        gamma=gamma,
        temperature=1.0,
        vocab_size=vocab,
        generator=g,
        hidden=hidden,
    )
    b = batch["input_ids"].shape[0]
    assert chains.draft.shape[:2] == (len(starts) * b, gamma)
    assert chains.tokens.shape == (len(starts) * b, gamma - 1)
    for i, t in enumerate(starts):
        for row in range(b):
            n = i * b + row
            real = int(batch["attention_mask"][row].sum())
            if t + 1 >= real:  # a start past the row's text: masked out
                assert not chains.mask[n]
                continue
            assert chains.mask[n]
            seq = torch.cat([batch["input_ids"][row, : t + 1], chains.tokens[n]]).unsqueeze(0)
            for model, got in ((draft, chains.draft[n]), (target, chains.target[n])):
                with torch.no_grad():
                    out = model(input_ids=seq, output_hidden_states=hidden)
                want = (
                    out.hidden_states[-1][0, -gamma:] if hidden else out.logits[0, -gamma:, :vocab]
                )
                torch.testing.assert_close(got.detach(), want, atol=2e-4, rtol=2e-4)


def test_the_draft_samples_from_its_own_distribution_at_each_step(tokenizer_draft_target):
    """Token k of a chain follows the draft's distribution after prefix + chain[:k]: at a
    low temperature it is the argmax of that sequence's logits."""
    tok, draft, target = tokenizer_draft_target
    vocab = len(tok)
    batch = _batch(vocab, [12, 12])
    chains = sample_chains(
        draft,
        target,
        batch,
        [3, 7],
        gamma=4,
        temperature=1e-4,
        vocab_size=vocab,
        generator=torch.Generator().manual_seed(0),
    )
    argmax = chains.draft[:, :-1].argmax(-1)
    assert torch.equal(chains.tokens, argmax)


def test_the_gradient_reaches_the_draft_only(tokenizer_draft_target):
    tok, draft, target = tokenizer_draft_target
    batch = _batch(len(tok), [10])
    chains = sample_chains(
        draft,
        target,
        batch,
        [4, 6],
        gamma=3,
        temperature=1.0,
        vocab_size=len(tok),
    )
    assert chains.draft.requires_grad and not chains.target.requires_grad


def test_flash_attention_is_refused_by_name(tokenizer_draft_target):
    tok, draft, target = tokenizer_draft_target
    original = draft.config._attn_implementation
    draft.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(UserError, match="4-D mask"):
            sample_chains(
                draft,
                target,
                _batch(len(tok), [8]),
                [3],
                gamma=2,
                temperature=1.0,
                vocab_size=len(tok),
            )
    finally:
        draft.config._attn_implementation = original


def test_chains_from_a_repeated_start_share_their_prefix_and_draw_apart(tokenizer_draft_target):
    """A start repeated in `starts` gives independent draws from the same prefix, in the
    order `prefix_groups` names them (benchmarks/tau_variance.py's several chains per
    start)."""
    tok, draft, target = tokenizer_draft_target
    vocab = len(tok)
    batch = _batch(vocab, [12, 12])
    starts = [3, 3, 3, 7, 7, 7]
    chains = sample_chains(
        draft,
        target,
        batch,
        starts,
        gamma=4,
        temperature=1.0,
        vocab_size=vocab,
        generator=torch.Generator().manual_seed(0),
    )
    groups = prefix_groups(starts, 2)
    assert len(groups) == len(chains.tokens) == 12
    first = chains.draft[:, 0]  # the teacher-forced position: the prefix's alone
    for g in groups.unique():
        members = (groups == g).nonzero()[:, 0]
        assert len(members) == 3
        for m in members[1:]:
            torch.testing.assert_close(first[m], first[members[0]])
    leaders = torch.stack([first[groups == g][0] for g in groups.unique()])
    assert torch.cdist(leaders, leaders).fill_diagonal_(1.0).min() > 1e-3  # 4 distinct prefixes
    # independent draws at T = 1: the chains of a prefix are not all the same chain
    assert any(
        len({tuple(t) for t in chains.tokens[groups == g].tolist()}) > 1 for g in groups.unique()
    )
