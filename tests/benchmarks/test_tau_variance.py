"""benchmarks/tau_variance.py's gradient: one flat vector over the draft's parameters, the
same chains giving the same gradient whatever the baseline when every chain is accepted
(the score term's coefficient is then 0 under both)."""

import torch

from benchmarks.tau_variance import gradient
from tests.helpers import make_model, make_tokenizer


def _batch(vocab: int) -> dict:
    ids = torch.randint(1, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    ones = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": ones, "loss_mask": ones.bool()}


def test_gradient_is_flat_and_finite_for_each_configuration():
    tok = make_tokenizer()
    draft = make_model(tok, hidden=32, layers=1, seed=1).eval()
    target = make_model(tok, hidden=48, layers=2, seed=2).eval()
    size = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    for baseline in ("reward", "coefficient"):
        for per_start in (1, 2):
            g = torch.Generator().manual_seed(0)
            grad = gradient(draft, target, _batch(len(tok)), [3, 7], per_start, baseline,
                            gamma=3, vocab=len(tok), g=g)  # fmt: skip
            assert grad.shape == (size,) and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_a_draft_that_is_the_target_gets_the_same_gradient_under_both_baselines():
    tok = make_tokenizer()
    model = make_model(tok, hidden=32, layers=1, seed=1).eval()
    grads = [
        gradient(
            model,
            model,
            _batch(len(tok)),
            [3, 7],
            1,
            baseline,
            gamma=3,
            vocab=len(tok),
            g=torch.Generator().manual_seed(0),
        )  # fmt: skip
        for baseline in ("reward", "coefficient")
    ]
    torch.testing.assert_close(grads[0], grads[1])
