"""The speculative decoding engine with a reduced-vocabulary standalone or parallel draft
(drafts/standalone/reduced_vocab.py, drafts/parallel/) stays lossless: greedy output is the target's
greedy output, and at T = 1 the first two sampled tokens follow the target's distribution
(chi-square), although the draft never proposes a token outside V_d and the target often
wants one."""

import pytest
import torch

from specdistill import drafts
from specdistill.drafts.parallel import add_mask_token
from specdistill.drafts.standalone.reduced_vocab import with_reduced_head
from specdistill.drafts.vocab_map import build_vocab_map
from specdistill.eval import engine
from tests.eval.helpers import (
    N_NEW,
    V_SMALL,
    chi_square_pvalue,
    joint_first_two,
    perturbed,
    reference_greedy,
    sample_pairs,
    tiny_llama,
)


def reduce(model, k: int, seed: int):
    vocab = model.config.vocab_size
    counts = torch.randint(0, 1000, (vocab,), generator=torch.Generator().manual_seed(seed))
    d2t, t2d = build_vocab_map(counts, k)
    return with_reduced_head(model, d2t, t2d).eval(), t2d


@pytest.fixture(scope="module")
def reduced_pair():
    target = tiny_llama(0, vocab=96, hidden=64, layers=2, init=0.2)
    draft, t2d = reduce(perturbed(target, 0.015, seed=1), 72, seed=0)
    return target, draft, t2d


def as_parallel(draft):
    """The reduced draft with a mask token: a reduced parallel draft (untrained mask)."""
    import copy

    parallel = copy.deepcopy(draft)
    add_mask_token(parallel)
    return parallel


@pytest.mark.parametrize(
    "gamma, batch_size, parallel",
    [(1, 5, False), (3, 2, False), (6, 5, False), (3, 2, True), (6, 5, True)],
)
def test_greedy_equals_target_greedy(reduced_pair, gamma, batch_size, parallel):
    target, draft, t2d = reduced_pair
    if parallel:
        draft = as_parallel(draft)
    kind = drafts.ReducedParallel if parallel else drafts.ReducedStandalone
    assert drafts.type_of(draft) is kind
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 11, 6, 1, 8)]
    out = engine.generate(
        target, draft, prompts, gamma=gamma, batch_size=batch_size, max_new_tokens=N_NEW
    )
    references = [reference_greedy(target, p, N_NEW) for p in prompts]
    assert out.sequences == references
    # the target's text leaves V_d, which the draft can never propose: those are rejections
    assert any(not t2d[t] for seq in references for t in seq)
    accepted = [n for r in out.rounds for n in r.accepted]
    assert any(n > 0 for n in accepted) and any(n < gamma for n in accepted)


@pytest.mark.parametrize("parallel", [False, True])
def test_sampling_is_lossless_at_temperature_one(parallel):
    target = tiny_llama(0, vocab=V_SMALL, hidden=32, layers=1, init=0.2)
    draft, t2d = reduce(perturbed(target, 0.04, seed=1), 5, seed=2)
    if parallel:
        draft = as_parallel(draft)
        assert drafts.type_of(draft) is drafts.ReducedParallel
        assert draft.get_input_embeddings().weight.shape[0] == V_SMALL + 1
        t2d = t2d[:V_SMALL]
    assert int((~t2d).sum()) == V_SMALL - 5
    out = sample_pairs((target, draft), 2)
    first = [n for r in out.rounds for n, s in zip(r.accepted, r.starts, strict=True) if s == 0]
    assert 0.1 < sum(n < 2 for n in first) / len(first) < 0.9
    emitted = torch.tensor([s[:2] for s in out.sequences])
    assert bool((~t2d[emitted]).any())  # tokens outside V_d come from the target's residual
    assert chi_square_pvalue(out.sequences, joint_first_two(target, 1.0, None, None)) > 1e-3
