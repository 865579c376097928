"""The acceptance head (drafts/acceptance_head.py, losses/acceptance_head.py): its label is
α = Σ min(p, q), its loss is minimised at the label and never reaches the draft, it reads the
hidden state the draft's output head reads, and it is saved and loaded with the draft (off
when its files are absent or the loader says so; a damaged head is a one-line error)."""

import json
import math
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaForCausalLM

from specdistill.drafts.acceptance_head import (
    CONFIG,
    WEIGHTS,
    AcceptanceHead,
    AcceptanceHeadConfig,
    HeadInputs,
    align_hidden,
    attach_head,
    attached_head,
    chunked_head_loss,
    draft_stats,
    head_features,
    head_loss,
    load_acceptance_head,
    save_acceptance_head,
)
from specdistill.drafts.align import shifted_hidden, shifted_logits
from specdistill.drafts.eagle3 import Eagle3
from specdistill.drafts.eagle3.head import Eagle3Head, build_vocab_map
from specdistill.drafts.loader import load_draft
from specdistill.drafts.standalone import Standalone
from specdistill.losses import SparseTarget, acceptance, acceptance_head_loss, acceptance_label
from specdistill.models.hub import BrokenWeightsError, IncompleteDraftError, load_tokenizer


def trained_head(hidden_size: int, seed: int = 0, **fields) -> AcceptanceHead:
    """A head with every weight random (an untrained head's last layer is zero)."""
    torch.manual_seed(seed)
    head = AcceptanceHead(AcceptanceHeadConfig(hidden_size=hidden_size, inner_size=8, **fields))
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0.0, 0.5)
    return head


def tiny_batch(vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, 12), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids, dtype=torch.bool),
    }


@pytest.fixture(scope="module")
def tiny_draft(tiny_pair):
    return LlamaForCausalLM.from_pretrained(tiny_pair[1])


@pytest.fixture(scope="module")
def eagle3_head(tiny_pair) -> Eagle3Head:
    """An EAGLE-3 head on the tiny target (V_d 100 of the target's vocabulary)."""
    target = LlamaForCausalLM.from_pretrained(tiny_pair[0])
    torch.manual_seed(0)
    head = Eagle3Head.from_target(target, draft_vocab_size=100, aux_layers=[0, 1])
    d2t, t2d = build_vocab_map(torch.randint(0, 1000, (target.config.vocab_size,)), 100)
    head.set_vocab_map(d2t, t2d, target.get_output_embeddings().weight)
    return head


# ----------------------------------------------------------------------------- label and loss


def test_the_label_is_the_sum_of_min_p_q_at_the_serving_temperature():
    g = torch.Generator().manual_seed(0)
    draft, target = torch.randn(3, 5, 40, generator=g), torch.randn(3, 5, 40, generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.3
    label = acceptance_label(draft, target, mask, temperature=0.7)
    q, p = (draft / 0.7).softmax(-1), (target / 0.7).softmax(-1)
    by_hand = torch.minimum(p, q).sum(-1)
    assert torch.allclose(label[mask], by_hand[mask], atol=1e-6)
    assert (label[~mask] == 0).all()
    assert torch.equal(label, acceptance(draft, target, 0.7, mask))
    greedy = acceptance_label(draft, target, temperature=0.0)
    assert torch.equal(greedy, (draft.argmax(-1) == target.argmax(-1)).float())


def test_the_loss_is_minimised_where_the_prediction_equals_the_label():
    g = torch.Generator().manual_seed(1)
    draft, target = torch.randn(4, 6, 30, generator=g), torch.randn(4, 6, 30, generator=g)
    label = acceptance_label(draft, target)
    assert ((label > 0.01) & (label < 0.99)).all()
    at_label = torch.logit(label.double()).requires_grad_()
    loss, n = acceptance_head_loss(at_label, draft, target)
    loss.backward()
    assert n == 24
    assert at_label.grad.abs().max() < 1e-9  # d BCE / d logit = sigmoid(logit) − label
    for shift in (-0.2, 0.2):
        other, _ = acceptance_head_loss(at_label.detach() + shift, draft, target)
        assert other > loss.detach()


def test_the_head_never_changes_the_draft_with_stop_gradient():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 5, 16, generator=g, requires_grad=True)
    draft = torch.randn(2, 5, 30, generator=g, requires_grad=True)
    target = torch.randn(2, 5, 30, generator=g)
    head = trained_head(16)
    loss, _ = acceptance_head_loss(head(hidden, draft), draft, target, temperature=1.0)
    loss.backward()
    assert hidden.grad is None and draft.grad is None  # neither through the head nor the label
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())

    loss, _ = acceptance_head_loss(head(hidden, draft, stop_gradient=False), draft, target)
    loss.backward()  # without stop_gradient the head's loss does reach the draft's outputs
    assert hidden.grad.abs().sum() > 0 and draft.grad.abs().sum() > 0


def test_masked_positions_contribute_nothing_and_pred_may_carry_a_last_dim_of_one():
    g = torch.Generator().manual_seed(3)
    draft, target = torch.randn(2, 4, 20, generator=g), torch.randn(2, 4, 20, generator=g)
    mask = torch.tensor([[True, True, False, True], [False, True, True, False]])
    pred = torch.randn(2, 4, 1, generator=g)
    pred[~mask] = float("nan")
    pred.requires_grad_()
    loss, n = acceptance_head_loss(pred, draft, target, mask)
    loss.backward()
    assert n == 5 and torch.isfinite(loss)
    assert torch.isfinite(pred.grad).all() and (pred.grad[~mask] == 0).all()
    label = acceptance_label(draft, target, mask)
    by_hand = torch.nn.functional.binary_cross_entropy_with_logits(
        pred.detach()[..., 0][mask], label[mask], reduction="sum"
    )
    assert torch.allclose(loss, by_hand)
    given, _ = acceptance_head_loss(pred.detach(), None, None, mask, label=label)
    assert torch.allclose(given, by_hand)


def test_an_untrained_head_predicts_its_prior_and_reads_the_draft_stats():
    g = torch.Generator().manual_seed(4)
    head = AcceptanceHead(AcceptanceHeadConfig(hidden_size=16, prior=0.6))
    hidden, logits = torch.randn(3, 16, generator=g), torch.randn(3, 50, generator=g)
    assert torch.allclose(head.predict(hidden, logits), torch.full((3,), 0.6))
    with pytest.raises(ValueError, match="pass the draft's logits"):
        head(hidden)
    plain = AcceptanceHead(AcceptanceHeadConfig(hidden_size=16, draft_stats=False))
    assert plain(hidden).shape == (3, 1)
    # stats: top-1 probability and entropy, unchanged by −inf columns (outside V_d)
    stats = draft_stats(logits)
    p = logits.softmax(-1)
    assert torch.allclose(stats[:, 0], p.amax(-1))
    assert torch.allclose(stats[:, 1], -(p * p.log()).sum(-1), atol=1e-5)
    padded = torch.cat([logits, torch.full((3, 7), float("-inf"))], dim=-1)
    assert torch.allclose(draft_stats(padded), stats, atol=1e-6)
    assert head_features(hidden, logits).shape == (3, 18)


# ----------------------------------------------------------------------------- hidden states


def test_the_head_reads_what_the_output_head_reads_standalone(tiny_draft):
    batch = tiny_batch(tiny_draft.config.vocab_size)
    vocab = tiny_draft.config.vocab_size
    with torch.no_grad(), HeadInputs(tiny_draft) as captured:
        logits = shifted_logits(tiny_draft, batch, vocab)
    (hidden,) = align_hidden(captured.tensors, [logits])
    assert hidden.shape == (2, 11, tiny_draft.config.hidden_size)
    with torch.no_grad():
        assert torch.allclose(tiny_draft.lm_head(hidden), logits, atol=1e-6)
        assert torch.allclose(hidden, shifted_hidden(tiny_draft, batch), atol=1e-6)


def test_the_head_reads_what_the_output_head_reads_eagle3(eagle3_head, tiny_pair):
    target = LlamaForCausalLM.from_pretrained(tiny_pair[0])
    kind = Eagle3(eagle3_head, steps=2, vocab_size=target.config.vocab_size)
    batch = tiny_batch(target.config.vocab_size)
    with torch.no_grad(), HeadInputs(eagle3_head) as captured:
        drafts, _, masks = kind.depths(eagle3_head, target, batch)
    hidden = align_hidden(captured.tensors, drafts)
    assert len(captured.tensors) == 2 and len(hidden) == 2
    with torch.no_grad():
        for h, logits, mask in zip(hidden, drafts, masks, strict=True):
            assert h.shape[:2] == logits.shape[:2] == mask.shape
            assert torch.allclose(eagle3_head.lm_head(h), logits, atol=1e-5)


# ----------------------------------------------------------------------------- save and load


def same_head(a: AcceptanceHead, b: AcceptanceHead) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_standalone_draft_is_saved_and_loaded_with_its_head(tiny_pair, tiny_draft, tmp_path):
    head = trained_head(tiny_draft.config.hidden_size, temperature=1.0)
    attach_head(tiny_draft, head)
    try:
        Standalone(vocab_size=tiny_draft.config.vocab_size).save(
            tiny_draft, tmp_path, load_tokenizer(str(tiny_pair[1])), str(tiny_pair[0])
        )
    finally:
        attach_head(tiny_draft, None)
    assert attached_head(tiny_draft) is None
    entry = json.loads((tmp_path / CONFIG).read_text())["acceptance_head"]
    assert entry["version"] == 1 and entry["hidden_size"] == tiny_draft.config.hidden_size
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert not any("acceptance" in name for name in f.keys())  # the draft's file is its own

    model = load_draft(str(tmp_path))
    loaded = model.acceptance_head
    assert isinstance(loaded, AcceptanceHead) and same_head(loaded, head)
    assert not any("acceptance" in name for name in model.state_dict())
    g = torch.Generator().manual_seed(5)
    hidden, logits = torch.randn(4, tiny_draft.config.hidden_size, generator=g), torch.randn(4, 9)
    assert torch.equal(loaded.predict(hidden, logits), head.eval().predict(hidden, logits))
    model.to(torch.bfloat16)  # the head stays float32 and reads any dtype
    assert loaded.predict(hidden.bfloat16(), logits.bfloat16()).dtype == torch.float32


def test_an_eagle3_head_is_saved_and_loaded_with_its_acceptance_head(
    tiny_pair, eagle3_head, tmp_path
):
    head = trained_head(eagle3_head.config.hidden_size, seed=1)
    kind = Eagle3(eagle3_head, steps=2, vocab_size=eagle3_head.config.vocab_size)
    attach_head(eagle3_head, head)
    try:
        kind.save(eagle3_head, tmp_path, load_tokenizer(str(tiny_pair[0])), str(tiny_pair[0]))
    finally:
        attach_head(eagle3_head, None)
    model = load_draft(str(tmp_path))
    assert isinstance(model, Eagle3Head) and same_head(model.acceptance_head, head)
    assert "acceptance_head" not in load_draft(str(tmp_path), use_acceptance_head=False).__dict__


def test_the_off_switch_a_draft_without_head_files_or_the_loader_flag(tiny_pair, tmp_path):
    assert not hasattr(load_draft(str(tiny_pair[1])), "acceptance_head")
    shutil.copytree(tiny_pair[1], tmp_path / "draft")
    save_acceptance_head(trained_head(16), tmp_path / "draft")
    assert isinstance(load_draft(str(tmp_path / "draft")).acceptance_head, AcceptanceHead)
    off = load_draft(str(tmp_path / "draft"), use_acceptance_head=False)
    assert not hasattr(off, "acceptance_head")
    # saving a draft without a head over that directory removes the old head's files
    Standalone(vocab_size=off.config.vocab_size).save(
        off, tmp_path / "draft", load_tokenizer(str(tiny_pair[1])), str(tiny_pair[0])
    )
    assert not any((tmp_path / "draft" / name).exists() for name in (WEIGHTS, CONFIG))
    assert not hasattr(load_draft(str(tmp_path / "draft")), "acceptance_head")


@pytest.fixture
def draft_with_head(tiny_pair, tmp_path):
    path = tmp_path / "draft"
    shutil.copytree(tiny_pair[1], path)
    save_acceptance_head(trained_head(16), path)
    return path


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message and isinstance(error.value, ValueError)
    return message


def test_a_cut_short_head_file_is_a_one_line_error_naming_it(draft_with_head):
    weights = draft_with_head / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(BrokenWeightsError) as error:
        load_draft(str(draft_with_head))
    assert str(weights) in one_line(error)
    with pytest.raises(BrokenWeightsError) as error:
        load_acceptance_head(draft_with_head)
    assert str(weights) in one_line(error)


@pytest.mark.parametrize("damage", ["no weights", "no config", "bad json", "version", "sizes"])
def test_an_incomplete_head_is_a_one_line_error_naming_the_file(draft_with_head, damage):
    weights, config = draft_with_head / WEIGHTS, draft_with_head / CONFIG
    entry = json.loads(config.read_text())
    named = config
    if damage == "no weights":
        weights.unlink()
        named = weights
    elif damage == "no config":
        config.unlink()
    elif damage == "bad json":
        config.write_text("{not json")
    elif damage == "version":
        entry["acceptance_head"]["version"] = 99
        config.write_text(json.dumps(entry))
    else:  # the config says another inner size than the weights hold
        entry["acceptance_head"]["inner_size"] = 9
        config.write_text(json.dumps(entry))
        named = weights
    with pytest.raises(IncompleteDraftError) as error:
        load_draft(str(draft_with_head))
    assert str(named) in one_line(error)


def test_a_head_for_another_hidden_size_is_refused(tiny_pair, tmp_path):
    shutil.copytree(tiny_pair[1], tmp_path / "draft")
    save_acceptance_head(trained_head(24), tmp_path / "draft")
    with pytest.raises(IncompleteDraftError, match="hidden size 24, the draft's is 16") as error:
        load_draft(str(tmp_path / "draft"))
    assert str(tmp_path / "draft" / CONFIG) in one_line(error)


def test_the_prior_sets_the_initial_bias():
    head = AcceptanceHead(AcceptanceHeadConfig(hidden_size=4, prior=0.25))
    assert math.isclose(float(torch.sigmoid(head.fc2.bias.detach())), 0.25, rel_tol=1e-6)
    assert (head.fc2.weight == 0).all()


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_exports_leave_the_head_out(draft_with_head, tmp_path, fmt):
    from specdistill.train.export import export

    out = export(draft_with_head, fmt, tmp_path / "out", str(draft_with_head))
    assert not any((out / name).exists() for name in (WEIGHTS, CONFIG))
    assert not hasattr(load_draft(str(out)), "acceptance_head")


def test_head_loss_over_eagle3_depths_trains_the_head_only(eagle3_head, tiny_pair):
    target = LlamaForCausalLM.from_pretrained(tiny_pair[0])
    kind = Eagle3(eagle3_head, steps=2, vocab_size=target.config.vocab_size)
    assert kind.d2t is not None  # V_d 100 < V: the label is α on the raw target mass
    batch = tiny_batch(target.config.vocab_size, seed=1)
    eagle3_head.zero_grad(set_to_none=True)
    with HeadInputs(eagle3_head) as captured:
        drafts, targets, masks = kind.depths(eagle3_head, target, batch)
    head = trained_head(eagle3_head.config.hidden_size, seed=2)
    hidden = align_hidden(captured.tensors, drafts)
    result = head_loss(head, hidden, drafts, targets, masks, temperature=0.8, d2t=kind.d2t)
    result.loss_sum.backward()
    assert all(p.grad is None for p in eagle3_head.parameters())
    assert head.fc1.weight.grad.abs().sum() > 0
    by_hand = 0.0
    for h, d, t, m, label in zip(hidden, drafts, targets, masks, result.labels, strict=True):
        assert torch.equal(label, acceptance(d.detach(), t, 0.8, m, d2t=kind.d2t))
        pred = head(h, d).detach()[..., 0]
        by_hand += torch.nn.functional.binary_cross_entropy_with_logits(
            pred[m], label[m], reduction="sum"
        )
    assert torch.allclose(result.loss_sum.detach(), by_hand, atol=1e-4)
    assert result.n_valid == sum(int(m.sum()) for m in masks)
    assert all(p.shape == m.shape for p, m in zip(result.predicted, masks, strict=True))


def test_draft_stats_are_the_same_computed_in_chunks_of_rows():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 7, 40, generator=g) * 3
    whole = draft_stats(logits, rows=10_000)
    assert whole.shape == (3, 7, 2)
    assert torch.allclose(draft_stats(logits, rows=4), whole)
    assert draft_stats(logits[:, :0]).shape == (3, 0, 2)


def test_the_chunked_head_loss_equals_the_head_loss_on_whole_logits(tiny_pair, tiny_draft):
    target = LlamaForCausalLM.from_pretrained(tiny_pair[0])
    vocab = target.config.vocab_size
    batch = tiny_batch(vocab, seed=2)
    mask = torch.rand(2, 11, generator=torch.Generator().manual_seed(3)) > 0.3
    head = trained_head(tiny_draft.config.hidden_size, seed=3)
    with torch.no_grad():
        d_hidden, t_hidden = shifted_hidden(tiny_draft, batch), shifted_hidden(target, batch)
        d_logits = shifted_logits(tiny_draft, batch, vocab)
        t_logits = shifted_logits(target, batch, vocab)
    whole = head_loss(head, [d_hidden], [d_logits], [t_logits], [mask], temperature=0.9)
    top = t_logits.softmax(-1).topk(vocab, dim=-1)
    sparse = SparseTarget(top.indices, top.values)
    for chunk, t in ((5, t_logits), (7, (t_hidden, target.lm_head.weight)), (1000, sparse)):
        part = chunked_head_loss(
            head, d_hidden, tiny_draft.lm_head.weight, t, mask, chunk_size=chunk, temperature=0.9
        )
        assert torch.allclose(part.loss_sum, whole.loss_sum, atol=1e-4)
        assert part.n_valid == whole.n_valid == int(mask.sum())
        assert torch.allclose(part.labels[0], whole.labels[0], atol=1e-5)
        assert torch.allclose(part.predicted[0], whole.predicted[0], atol=1e-6)


@pytest.mark.parametrize("stats", [True, False])
def test_the_engines_per_step_prediction_is_predict(stats):
    head = AcceptanceHead(AcceptanceHeadConfig(hidden_size=16, inner_size=8, draft_stats=stats))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    hidden, logits = torch.randn(5, 16, generator=g), torch.randn(5, 40, generator=g) * 4
    logits[1, :7] = float("-inf")  # an EAGLE-3 head's columns outside its vocabulary
    fast = head.predict_rows(hidden, logits)
    assert fast.shape == (5,) and fast.dtype == torch.float32
    assert torch.allclose(fast, head.predict(hidden, logits), atol=1e-6)
    low = hidden.bfloat16()
    assert torch.allclose(head.predict_rows(low, logits), head.predict(low, logits), atol=1e-6)
