"""Rows admitted together are prefilled in groups of similar length (models/kv_cache.py
`length_groups`), then put back in the order given: the same logits, the same cache and the
same next steps as rows prefilled one by one, with far fewer padding tokens."""

import pytest
import torch

from specdistill.models.kv_cache import PREFILL_SLACK, KVStream, length_groups
from tests.models.helpers import FAMILIES, VOCAB

CPU = torch.device("cpu")


def padded_tokens(lengths, groups) -> int:
    return sum(max(lengths[i] for i in g) * len(g) for g in groups)


@pytest.mark.parametrize(
    "lengths",
    [[116, 503, 74, 87, 266, 57, 175, 120], [5] * 6, [40, 1, 3], [9], list(range(1, 40))],
)
def test_groups_cover_every_row_once_within_the_slack(lengths):
    groups = length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:  # each group padded to its longest holds at most 1 + slack its tokens
        real = sum(lengths[i] for i in g)
        assert max(lengths[i] for i in g) * len(g) <= (1 + PREFILL_SLACK) * real or len(g) == 1
    if len(set(lengths)) == 1:
        assert len(groups) == 1


def test_groups_cut_the_padding_of_chat_prompts():
    lengths = [116, 503, 74, 87, 266, 57, 175, 120, 91, 145, 80, 415]
    one = padded_tokens(lengths, [list(range(len(lengths)))])
    grouped = padded_tokens(lengths, length_groups(lengths))
    assert one > 2.5 * sum(lengths) and grouped <= (1 + PREFILL_SLACK) * sum(lengths)


def test_an_empty_prefix_keeps_one_prefill():
    assert length_groups([0, 7, 30]) == [[0, 1, 2]]


@pytest.mark.parametrize("lean", [True, False])
def test_grouped_admission_matches_rows_prefilled_alone(lean):
    torch.manual_seed(0)
    model = FAMILIES["llama-smollm2-shape"]().eval()
    prompts = [
        torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (3, 40, 5, 41, 12)
    ]
    assert len(length_groups([len(p) for p in prompts])) > 1
    with torch.no_grad():
        stream = KVStream(model, VOCAB, CPU, lean=lean)
        stream.admit(prompts[:1])  # a running batch: the new rows join it
        logits, _, valid = stream.admit(prompts[1:])
        assert valid.sum(1).tolist() == [len(p) for p in prompts[1:]]
        nxt = torch.tensor([[7]] * len(prompts))
        after = stream.forward(nxt, torch.ones_like(nxt, dtype=torch.bool), keep=1)[:, -1]
        for i, prompt in enumerate(prompts):
            alone = KVStream(model, VOCAB, CPU, lean=lean)
            first = alone.admit([prompt])[0][0]
            if i:
                torch.testing.assert_close(logits[i - 1], first, atol=2e-5, rtol=1e-5)
            step = alone.forward(torch.tensor([[7]]), torch.ones(1, 1, dtype=torch.bool), keep=1)
            torch.testing.assert_close(after[i], step[0, -1], atol=2e-5, rtol=1e-5)
