"""An EAGLE-3 head's own chains (drafts/eagle3/chains.py): each chain position gets the
logits the head gives a text that continues with the chain, and the target's logits on
prefix + chain; the tokens are the head's own samples."""

import torch

from specdistill.drafts.eagle3.chains import sample_head_chains
from specdistill.drafts.eagle3.head import FeatureCapture
from tests.eagle3_heads import VOCAB, head_for, tiny_target


def _setup(lengths=(16, 11)):
    target = tiny_target(layers=2)
    head = head_for(target, draft_vocab_size=40, aux_layers=[0, 1])
    g = torch.Generator().manual_seed(0)
    n = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), n), generator=g)
    attention = torch.zeros(len(lengths), n, dtype=torch.long)
    for row, length in enumerate(lengths):
        attention[row, :length] = 1
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": attention.bool()}
    return target, head, batch


def _features(target, head, ids, attention):
    with torch.no_grad(), FeatureCapture(target, head.aux_layers) as capture:
        target(input_ids=ids, attention_mask=attention)
        return capture.features()


def test_chain_logits_equal_the_head_and_target_on_the_continued_text():
    target, head, batch = _setup()
    ids, attention = batch["input_ids"], batch["attention_mask"]
    starts, gamma = [3, 6, 9, 12], 4
    chains = sample_head_chains(
        head,
        target,
        _features(target, head, ids, attention),
        batch,
        starts,
        gamma=gamma,
        temperature=1.0,
        vocab_size=VOCAB,
        d2t=head.d2t,
        generator=torch.Generator().manual_seed(1),
    )
    b = ids.shape[0]
    assert chains.draft.shape == (len(starts) * b, gamma, 40)
    for i, t in enumerate(starts):
        for row in range(b):
            n = i * b + row
            if t + 1 >= int(attention[row].sum()):
                assert not chains.mask[n]
                continue
            assert chains.mask[n]
            own = chains.tokens[n] + head.d2t[chains.tokens[n]]  # target-vocabulary ids
            seq = torch.cat([ids[row, : t + 1], own]).unsqueeze(0)
            with torch.no_grad():
                want_t = target(input_ids=seq).logits[0, -gamma:]
                features = _features(target, head, seq, None)
                steps = head.unroll(features, seq, None, gamma)  # teacher-forced on seq
            want_d = torch.stack([s[0, t - 1] for s in steps])
            torch.testing.assert_close(chains.target[n], want_t, atol=2e-4, rtol=2e-4)
            torch.testing.assert_close(chains.draft[n].detach(), want_d, atol=2e-4, rtol=2e-4)


def test_tokens_are_the_heads_own_samples_and_start_zero_is_masked():
    target, head, batch = _setup((12, 12))
    ids, attention = batch["input_ids"], batch["attention_mask"]
    chains = sample_head_chains(
        head,
        target,
        _features(target, head, ids, attention),
        batch,
        [0, 4, 8],
        gamma=3,
        temperature=1e-4,
        vocab_size=VOCAB,
        d2t=head.d2t,
        generator=torch.Generator().manual_seed(0),
    )
    assert torch.equal(chains.tokens, chains.draft[:, :-1].argmax(-1))
    assert not chains.mask[:2].any() and chains.mask[2:].all()
    assert chains.draft.requires_grad and not chains.target.requires_grad
