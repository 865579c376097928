"""benchmarks/tau_gap.py's sums: a draft equal to the target accepts every position; a
draft with no overlap accepts none; the table's ratio column is against the first draft."""

import torch

from benchmarks.tau_gap import Gap, expected_length, table


def _chains(n=6, gamma=3, vocab=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(n, gamma, vocab, generator=g).log_softmax(-1)
    tokens = torch.randint(vocab, (n, gamma - 1), generator=g)
    return logp, tokens


def test_a_draft_equal_to_the_target_accepts_the_whole_chain():
    logp, tokens = _chains()
    gap = Gap(3)
    gap.add(logp, logp, tokens, torch.ones(6, dtype=torch.bool))
    assert abs(expected_length(gap) - 3.0) < 1e-5
    assert torch.allclose(gap.alpha / gap.n, torch.ones(3, dtype=torch.float64))


def test_disjoint_supports_accept_nothing_and_masked_chains_do_not_count():
    vocab = 4
    draft = torch.full((2, 2, vocab), -1e9)
    draft[..., :2] = torch.tensor([0.5, 0.5]).log()
    target = torch.full((2, 2, vocab), -1e9)
    target[..., 2:] = torch.tensor([0.5, 0.5]).log()
    tokens = torch.zeros(2, 1, dtype=torch.long)
    gap = Gap(2)
    gap.add(draft, target, tokens, torch.tensor([True, False]))
    assert gap.n == 1 and expected_length(gap) < 1e-6
    text = table({"a": gap, "b": gap})
    assert "| b | 0.000 |" in text
