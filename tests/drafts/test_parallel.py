"""The parallel draft type (drafts/parallel/): the training forward sees what the drafter
sees, the engine stays exact (greedy) and lossless (χ²) with a block drafted in one forward,
save / detect / load, and the depths feed the library's multi-depth loss."""

import copy

import pytest
import torch

from specdistill import drafts, losses
from specdistill.drafts.parallel import (
    Parallel,
    ParallelDrafter,
    add_mask_token,
    block_logits,
    mask_token,
)
from specdistill.drafts.types import Drafter, DraftType
from specdistill.eval import engine
from tests.eval.helpers import (
    N_NEW,
    PREFIX,
    V_SMALL,
    chi_square_pvalue,
    joint_first_two,
    perturbed,
    reference_greedy,
    tiny_llama,
)

VOCAB = 16  # small enough that a mask position's greedy draft is sometimes right


def parallel_copy(model, seed: int = 5, scale: float = 0.0):
    """A parallel draft made from `model`: a mask token added, its embedding moved off the
    mean (so the masks carry something), the rest perturbed by `scale`."""
    draft = perturbed(model, scale, seed) if scale else copy.deepcopy(model)
    mask_id = add_mask_token(draft)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        row = draft.get_input_embeddings().weight[mask_id]
        row.add_(0.2 * torch.randn(row.shape, generator=g))
    return draft.eval()


@pytest.fixture(scope="module")
def parallel_pair():
    """(target, draft): a tiny random Llama and a parallel draft made from a perturbed copy."""
    target = tiny_llama(0, vocab=VOCAB, hidden=32, layers=2, init=0.2)
    return target, parallel_copy(target, scale=0.02)


@pytest.fixture(scope="module")
def parallel_prompts():
    """Five random prompts of the parallel pair's vocabulary (VOCAB tokens)."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 11, 6, 1, 8)]


def test_a_mask_token_is_one_more_row_named_in_the_config(parallel_pair):
    target, draft = parallel_pair
    assert mask_token(target) is None and mask_token(draft) == VOCAB
    assert draft.get_input_embeddings().weight.shape[0] == VOCAB + 1
    assert add_mask_token(draft) == VOCAB  # idempotent
    assert drafts.type_of(draft) is Parallel and drafts.type_of(target) is drafts.Standalone
    assert Parallel.vocab_size_of(draft) == VOCAB  # the mask row is never a draft token
    assert drafts.compared_vocab_size(target, draft=draft) == VOCAB
    kind = Parallel(VOCAB, 3, VOCAB)
    assert isinstance(kind, DraftType)
    assert isinstance(Parallel.drafter(draft, VOCAB, torch.device("cpu")), Drafter)
    assert drafts.TYPES["parallel"] is Parallel


@torch.no_grad()
def test_block_forward_matches_the_inference_input(parallel_pair):
    """Depth k at anchor t of the training forward equals the draft run on tokens ≤ t and k
    mask tokens, which is what a round feeds it (right padding included)."""
    _, draft = parallel_pair
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 9), generator=g)
    attention = torch.ones_like(ids)
    attention[1, 6:] = 0
    blocks = block_logits(draft, ids, attention, VOCAB, 3, VOCAB)
    assert len(blocks) == 3 and blocks[0].shape == (2, 9, VOCAB)
    for row, length in ((0, 9), (1, 6)):
        for t in (0, 3, length - 1):
            for k in range(3):
                seq = ids[row, : t + 1].tolist() + [VOCAB] * k
                plain = draft(input_ids=torch.tensor([seq])).logits[0, -1, :VOCAB]
                torch.testing.assert_close(blocks[k][row, t], plain, atol=1e-4, rtol=1e-4)


def test_depths_align_with_the_target_and_feed_the_loss(parallel_pair):
    target, draft = parallel_pair
    kind = Parallel(VOCAB, 3, VOCAB)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 8), generator=g)
    attention = torch.ones_like(ids)
    attention[1, 5:] = 0
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": attention.bool()}
    d, t, m = kind.depths(draft, target, batch)
    assert len(d) == len(t) == len(m) == 3
    assert all(x.shape == (2, 7, VOCAB) for x in d + t)
    # Depth k at anchor t is compared with the target's prediction of token t + k + 1.
    with torch.no_grad():
        full = target(input_ids=ids).logits
    torch.testing.assert_close(t[2][0, 2], full[0, 4, :VOCAB])
    # Valid where token t + k + 1 is a real target: row 1 has 5 tokens.
    assert m[0][1].tolist() == [True] * 4 + [False] * 3
    assert m[2][1].tolist() == [True] * 2 + [False] * 5
    assert m[2][0].tolist() == [True] * 5 + [False] * 2
    loss_sum, n_valid, _ = losses.multi_depth_loss("fkl", d, t, m, weighting="expected_length")
    loss_sum.backward()
    grad = draft.get_input_embeddings().weight.grad
    assert n_valid == kind.count_mask(batch).sum() and grad[VOCAB].abs().sum() > 0
    draft.zero_grad()


# ----------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("gamma, batch_size", [(1, 5), (3, 2), (5, 5), (4, 1)])
def test_greedy_equals_target_greedy(parallel_pair, parallel_prompts, gamma, batch_size):
    target, draft = parallel_pair
    out = engine.generate(
        target, draft, parallel_prompts, gamma=gamma, batch_size=batch_size, max_new_tokens=N_NEW
    )
    assert out.sequences == [reference_greedy(target, p, N_NEW) for p in parallel_prompts]
    accepted = [n for r in out.rounds for n in r.accepted]
    # Rejected sometimes and accepted past a mask position sometimes, or neither the
    # rollback nor the masks' drafts are exercised.
    assert any(n < gamma for n in accepted)
    assert any(n == gamma for n in accepted) or gamma > 3
    if gamma > 1:
        assert any(n >= 2 for n in accepted)


def test_the_drafter_proposes_with_one_forward(parallel_pair, parallel_prompts, monkeypatch):
    target, draft = parallel_pair
    calls = []
    drafter = ParallelDrafter(draft, VOCAB, torch.device("cpu"))
    original = drafter.stream.forward

    def spy(tokens, valid, keep, **kwargs):
        calls.append((tokens.shape[1], keep))
        return original(tokens, valid, keep, **kwargs)

    drafter.stream.forward = spy
    drafter.admit(parallel_prompts[:2])
    proposal = drafter.propose(4, lambda logits: (logits.argmax(-1), None))
    assert proposal.tokens.shape == (2, 4) and len(calls) == 1 and calls[0][1] == 4
    assert (proposal.tokens < VOCAB).all()


@pytest.fixture(scope="module")
def small_parallel_pair():
    """(target, parallel draft) over V_SMALL tokens, for the χ² test of sampling."""
    target = tiny_llama(0, vocab=V_SMALL, hidden=32, layers=1, init=0.2)
    return target, parallel_copy(target, scale=0.04)


@pytest.mark.parametrize("gamma, temperature", [(2, 1.0), (3, 0.8)])
def test_sampling_is_lossless(small_parallel_pair, gamma, temperature):
    out = engine.generate(
        *small_parallel_pair,
        [PREFIX] * 20_000,
        gamma=gamma,
        temperature=temperature,
        max_new_tokens=gamma + 1,
        seed=0,
    )
    first = [n for r in out.rounds for n, s in zip(r.accepted, r.starts, strict=True) if s == 0]
    assert 0.1 < sum(n < gamma for n in first) / len(first) < 0.9
    assert any(n >= 2 for n in first)  # the mask position's draft takes part
    p = chi_square_pvalue(
        out.sequences, joint_first_two(small_parallel_pair[0], temperature, None, None)
    )
    assert p > 1e-3


# ----------------------------------------------------------------------------- on disk


def test_save_detect_load_round_trip(parallel_pair, tmp_path):
    from specdistill.drafts import loader
    from tests.helpers import make_tokenizer

    target, draft = parallel_pair
    kind = Parallel(VOCAB, 3, VOCAB)
    kind.save(draft, tmp_path / "d", make_tokenizer(), "target")
    assert drafts.detect(tmp_path / "d") is Parallel
    loaded = loader.load_draft(str(tmp_path / "d"))
    assert drafts.type_of(loaded) is Parallel and mask_token(loaded) == VOCAB
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        a = block_logits(draft, ids, torch.ones_like(ids), VOCAB, 3, VOCAB)
        b = block_logits(loaded, ids, torch.ones_like(ids), VOCAB, 3, VOCAB)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_the_trainer_adapts_a_standalone_draft(tiny_pair, tmp_path):
    """A recipe with draft.type=parallel turns a standalone draft into a parallel one: the
    saved draft has a mask token, is detected as parallel, and its held-out α is per depth."""
    from specdistill.train.config import load_recipe
    from specdistill.train.trainer import Trainer
    from tests.train.helpers import overrides

    out = tmp_path / "run"
    extra = {
        "draft.type": "parallel",
        "draft.parallel_depths": 3,
        "loss.depth_weighting": "expected_length",
        "train.max_steps": 4,
    }
    result = Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, out, **extra))).run()
    assert drafts.detect(out / "final") is Parallel
    from specdistill.drafts import loader

    loaded = loader.load_draft(str(out / "final"))
    assert mask_token(loaded) is not None and loaded.config.parallel_depths == 3
    assert 0.0 <= result["alpha"] <= 1.0


def test_chunked_losses_are_refused_by_name(tiny_pair, tmp_path):
    from specdistill.train.config import RecipeError, load_recipe
    from tests.train.helpers import overrides

    extra = {"draft.type": "parallel", "loss.chunk_size": 16}
    with pytest.raises(RecipeError, match="chunk_size is not supported for draft.type=parallel"):
        load_recipe(None, overrides(tiny_pair, tmp_path, **extra))


@torch.no_grad()
def test_each_proposal_is_the_drafts_own_prediction_through_its_masks(parallel_pair):
    """Round after round (with partial acceptance and rollback), the drafter's greedy block
    equals the draft run from scratch on the committed tokens plus k mask tokens."""
    _, draft = parallel_pair
    drafter = ParallelDrafter(draft, VOCAB, torch.device("cpu"))
    contexts = [[1, 2, 3, 4, 5], [7, 8]]
    drafter.admit([list(c) for c in contexts])
    for _ in range(3):
        proposal = drafter.propose(4, lambda logits: (logits.argmax(-1), None))
        host = []
        for i, (context, n) in enumerate(zip(contexts, (2, 0), strict=True)):
            expected = [
                int(
                    draft(input_ids=torch.tensor([context + [VOCAB] * k]))
                    .logits[0, -1, :VOCAB]
                    .argmax()
                )
                for k in range(4)
            ]
            assert proposal.tokens[i].tolist() == expected
            drafted = proposal.tokens[i].tolist()
            host.append([n, 9, *drafted])
            context += drafted[:n] + [9]
        drafter.commit(4, torch.tensor([2, 0]), host)


def test_the_acceptance_heads_inputs_are_each_depths_hidden_states(parallel_pair):
    """`Parallel.head_hidden` splits the block forward's one recording into its copies: the
    output head on depth k's hidden states gives depth k's logits."""
    from specdistill.drafts.acceptance_head import HeadInputs

    target, draft = parallel_pair
    kind = Parallel(vocab_size=VOCAB, steps=3, mask_id=mask_token(draft))
    ids = torch.randint(1, kind.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids, dtype=torch.bool),
    }
    with torch.no_grad(), HeadInputs(draft) as record:
        d_logits, _, _ = kind.depths(draft, target, batch)
    hidden = kind.head_hidden(record.tensors, d_logits)
    assert len(hidden) == 3
    head = draft.get_output_embeddings()
    for k in range(3):
        torch.testing.assert_close(head(hidden[k])[..., : kind.vocab_size], d_logits[k])
