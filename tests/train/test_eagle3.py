"""EAGLE-3 head: feature capture, training-time test equal to real drafting, vocabulary maps,
save / load, Llama and Qwen2 targets, and training through the ordinary trainer."""

import json
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM

from specdistill import losses
from specdistill.drafts import Eagle3
from specdistill.drafts.eagle3 import token_counts
from specdistill.drafts.eagle3.head import (
    Eagle3Head,
    FeatureCapture,
    VocabMapError,
    align_depths,
    build_vocab_map,
    check_vocab_map,
    default_aux_layers,
)
from specdistill.train.config import RecipeError, load_recipe
from specdistill.train.trainer import Trainer
from tests.eagle3_heads import VOCAB, head_for, tiny_target
from tests.train.helpers import eagle_overrides, run_cli


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_capture_is_the_input_of_the_aux_layers_in_the_same_forward(family):
    target = tiny_target(family)
    ids = torch.randint(0, VOCAB, (2, 9))
    calls = []
    hook = target.register_forward_hook(lambda *a: calls.append(1))
    with FeatureCapture(target, [1, 2, 3]) as capture:
        out = target(input_ids=ids, output_hidden_states=True)
    hook.remove()
    features = capture.features()
    assert len(calls) == 1
    assert torch.equal(features, torch.cat([out.hidden_states[i] for i in (1, 2, 3)], -1))
    # hooks are gone after the block
    assert all(not layer._forward_pre_hooks for layer in target.model.layers)
    with pytest.raises(ValueError, match="out of range"):
        FeatureCapture(target, [4])


def test_default_aux_layers():
    assert default_aux_layers(32) == [2, 16, 29]
    assert default_aux_layers(4) == [1, 2, 3]
    assert default_aux_layers(6) == [1, 3, 5]
    with pytest.raises(ValueError, match="aux_layers"):
        default_aux_layers(2)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_unroll_equals_cached_chain_drafting(family, norm_before_residual):
    """TTT depth k at chain t must be what drafting k steps from position t computes."""
    target = tiny_target(family)
    head = head_for(target, norm_before_residual=norm_before_residual)
    ids = torch.randint(0, VOCAB, (2, 14))
    with FeatureCapture(target, head.aux_layers) as capture:
        target(input_ids=ids)
    features = capture.features()
    steps = 4
    with torch.no_grad():
        unrolled = head.unroll(features, ids, torch.ones_like(ids), steps)
        for t in (0, 5, 9):
            cache = DynamicCache(config=head.config)
            out = head(
                ids[:, 1 : t + 2],
                head.fc(features[:, : t + 1]),
                torch.ones(2, t + 1, dtype=torch.bool),
                torch.arange(t + 1)[None].expand(2, -1),
                cache,
                logits_to_keep=1,
                full_vocab=False,
            )
            torch.testing.assert_close(out.logits[:, -1], unrolled[0][:, t])
            for k in range(1, steps):
                out = head(
                    ids[:, t + k + 1 : t + k + 2],
                    out.hidden_states[:, -1:],
                    torch.ones(2, t + 1 + k, dtype=torch.bool),
                    torch.full((2, 1), t + k),
                    cache,
                    logits_to_keep=1,
                    full_vocab=False,
                )
                torch.testing.assert_close(out.logits[:, -1], unrolled[k][:, t])


def test_unroll_rows_do_not_see_padding():
    target = tiny_target()
    head = head_for(target)
    ids = torch.randint(0, VOCAB, (1, 10))
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 4)], 1).long()
    with FeatureCapture(target, head.aux_layers) as capture:
        target(input_ids=padded, attention_mask=mask)
    f_pad = capture.features()
    with torch.no_grad():
        a = head.unroll(f_pad[:, :10], ids, None, 3)
        b = head.unroll(f_pad, padded, mask, 3)
    for k in range(3):
        valid = 10 - k - 1  # chains whose inputs stay inside the real tokens
        torch.testing.assert_close(a[k][:, :valid], b[k][:, :valid])


def test_align_depths_pairs_each_depth_with_the_right_target_position():
    b, t, steps = 2, 10, 3
    target_logits = torch.arange(t).float()[None, :, None].expand(b, t, 5)
    loss_mask = torch.ones(b, t, dtype=torch.bool)
    loss_mask[0, 6] = False
    drafts = [torch.zeros(b, t, 4) for _ in range(steps)]
    d, tg, m = align_depths(drafts, target_logits, loss_mask, torch.ones(b, t))
    assert all(x.shape[1] == t - steps - 1 for x in d + tg + m)
    for k in range(steps):
        # chain 0 at depth k predicts token k+2, from target position k+1
        assert tg[k][0, 0, 0] == k + 1
        assert not m[k][0, 6 - (k + 2)]  # token 6 is not a training token
    with pytest.raises(ValueError, match="too short"):
        align_depths(drafts, target_logits[:, :4], loss_mask[:, :4], torch.ones(b, 4))


def test_vocab_map_build_and_checks():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = build_vocab_map(counts, 4)
    assert (torch.arange(4) + d2t).tolist() == [0, 2, 3, 5]  # the 4 most frequent, by id
    assert t2d.tolist() == [True, False, True, True, False, True, False, False]
    check_vocab_map(d2t, t2d, 8, 4)
    bad = [
        (None, t2d, "missing d2t"),
        (d2t.int(), t2d, "int64"),
        (d2t + 10, t2d, "outside"),
        (torch.tensor([0, 1, 0, 2]), t2d, "same target id"),  # target ids 0, 2, 2, 5
        (d2t, t2d.clone().fill_(True), "marks 8"),
    ]
    for bad_d2t, bad_t2d, message in bad:
        with pytest.raises(VocabMapError, match=message):
            check_vocab_map(bad_d2t, bad_t2d, 8, 4)
    shifted = t2d.clone()
    shifted[5], shifted[6] = False, True
    with pytest.raises(VocabMapError, match="disagree"):
        check_vocab_map(d2t, shifted, 8, 4)
    with pytest.raises(VocabMapError, match="draft vocab size"):
        build_vocab_map(counts, 9)


def test_save_load_round_trip_and_corrupted_map(tmp_path):
    target = tiny_target()
    head = head_for(target)
    head.save_pretrained(tmp_path / "head", verifier="tiny")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == 40 and config["eagle_aux_hidden_state_layer_ids"] == [
        1,
        2,
        3,
    ]
    loaded = Eagle3Head.from_pretrained(tmp_path / "head").eval()
    ids = torch.randint(0, VOCAB, (2, 8))
    with FeatureCapture(target, head.aux_layers) as capture:
        target(input_ids=ids)
    features = capture.features()
    with torch.no_grad():
        mine, theirs = head.unroll(features, ids, None, 2), loaded.unroll(features, ids, None, 2)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    # A corrupted map is refused at save and at load.
    with torch.no_grad():
        head.d2t[3] = (2 + head.d2t[2]) - 3  # draft id 3 -> the target id of draft id 2
    with pytest.raises(VocabMapError):
        head.save_pretrained(tmp_path / "bad")
    from safetensors.torch import load_file, save_file

    state = load_file(tmp_path / "head" / "model.safetensors")
    del state["t2d"]
    save_file(state, tmp_path / "head" / "model.safetensors")
    with pytest.raises(VocabMapError, match="missing t2d"):
        Eagle3Head.from_pretrained(tmp_path / "head")


def test_embedding_is_the_targets_and_frozen():
    target = tiny_target()
    head = head_for(target)
    assert torch.equal(head.embed_tokens.weight, target.get_input_embeddings().weight)
    assert not head.embed_tokens.weight.requires_grad
    # lm_head starts from the target's output rows of the draft vocabulary
    fresh = Eagle3Head.from_target(target, draft_vocab_size=40)
    ids = fresh.draft_ids()
    assert torch.equal(fresh.lm_head.weight, target.lm_head.weight[ids])


def test_token_counts_use_loss_masked_tokens_only():
    data = [
        {"input_ids": torch.tensor([1, 2, 3, 3]), "loss_mask": torch.tensor([0, 1, 1, 0]).bool()},
        {"input_ids": torch.tensor([3, 4]), "loss_mask": torch.tensor([1, 1]).bool()},
    ]
    assert token_counts(data, 6).tolist() == [0, 0, 1, 2, 1, 0]


def test_eagle3_depth_losses_have_gradients_only_in_the_head():
    target = tiny_target()
    head = head_for(target).train()
    kind = Eagle3(head, steps=3, vocab_size=VOCAB)
    batch = {
        "input_ids": torch.randint(0, VOCAB, (2, 12)),
        "attention_mask": torch.ones(2, 12, dtype=torch.long),
        "loss_mask": torch.ones(2, 12, dtype=torch.bool),
    }
    drafts, targets, masks = kind.depths(head, target, batch)
    assert len(drafts) == 3 and drafts[0].shape[-1] == 40
    loss, n, alpha = losses.multi_depth_loss("lk_lambda", drafts, targets, masks, d2t=kind.d2t)
    loss.backward()
    assert int(n) == int(kind.count_mask(batch).sum()) == 2 * (12 - 3 - 1)
    assert head.fc.weight.grad is not None and head.fc.weight.grad.abs().sum() > 0
    assert head.embed_tokens.weight.grad is None
    assert all(p.grad is None for p in target.parameters())
    assert alpha.shape == (3,)


# ----------------------------------------------------------------------------- trainer


def test_trainer_trains_an_eagle3_head_and_saves_it(tiny_pair, sharp_target, tmp_path):
    out = tmp_path / "run"
    speculative = {
        "eval.speculative.every": 15,  # real decoding with the head during training
        "eval.speculative.gammas": "[1, 3]",
        "eval.speculative.prompts": 2,
        "eval.speculative.prompt_tokens": 8,
        "eval.speculative.max_new_tokens": 8,
    }
    recipe = load_recipe(None, eagle_overrides(tiny_pair, sharp_target, out, **speculative))
    result = Trainer.from_recipe(recipe).run()
    assert result["alpha"] > result["alpha_before"] + 0.05
    assert len(result["alpha_depth"]) == 3
    # The chained i.i.d. value; tau_pred replays rounds along the target's texts (issue 15).
    assert result["tau_pred_iid"][1] == pytest.approx(1 + result["alpha_depth"][0])
    assert set(result["tau_pred"]) == set(result["tau_pred_iid"])
    assert all(1.0 <= t <= g + 1 for g, t in result["tau_pred"].items())
    head = Eagle3Head.from_pretrained(out / "final")
    assert head.draft_vocab_size == 200 and head.aux_layers == [0, 1]
    # V_d = the most frequent loss-masked training tokens: the data's tokens are all in it
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(sharp_target)
    assert config["ttt_steps"] == head.ttt_steps == 3  # the depth trained: what the export writes
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert "eval/alpha_depth_2" in [m for m in records if "eval/alpha" in m][-1]
    spec = [m for m in records if "spec/best_gamma" in m]
    assert [m["step"] for m in spec] == [15, 30]
    assert all(1.0 <= m["spec/tau_3"] <= 4.0 for m in spec)
    # continue from the saved head
    more = Trainer.from_recipe(
        load_recipe(
            None,
            eagle_overrides(
                tiny_pair,
                sharp_target,
                tmp_path / "more",
                **{"draft.model": str(out / "final"), "train.max_steps": 1},
            ),
        )
    )
    assert torch.equal(more.accelerator.unwrap_model(more.draft).fc.weight, head.fc.weight)


def test_frozen_lm_head_stays_the_targets(tiny_pair, sharp_target, tmp_path):
    overrides = eagle_overrides(
        tiny_pair,
        sharp_target,
        tmp_path / "frozen",
        **{"draft.freeze_lm_head": "true", "draft.vocab_size": "null", "train.max_steps": 3},
    )
    trainer = Trainer.from_recipe(load_recipe(None, overrides))
    trainer.run()
    head = Eagle3Head.from_pretrained(tmp_path / "frozen" / "final")
    target = LlamaForCausalLM.from_pretrained(sharp_target)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight)
    trained = trainer.accelerator.unwrap_model(trainer.draft)
    assert not trained.lm_head.weight.requires_grad and trained.fc.weight.requires_grad


def test_eagle3_recipe_errors(tiny_pair, tmp_path):
    t = tiny_pair[0]
    with pytest.raises(RecipeError, match="lora"):
        load_recipe(None, eagle_overrides(tiny_pair, t, tmp_path, **{"draft.lora.r": 4}))
    with pytest.raises(RecipeError, match="chunk_size"):
        load_recipe(None, eagle_overrides(tiny_pair, t, tmp_path, **{"loss.chunk_size": 64}))
    with pytest.raises(RecipeError, match="draft.type"):
        load_recipe(None, eagle_overrides(tiny_pair, t, tmp_path, **{"draft.type": "medusa"}))
    with pytest.raises(RecipeError, match="eagle3 only"):
        load_recipe(None, ["draft.ttt_steps=5"])
    with pytest.raises(RecipeError, match="end_to_end"):
        load_recipe(None, ["loss.depth_weighting=end_to_end", "loss.name=fkl"])


def test_shipped_eagle3_recipe_runs_on_the_embedded_tiny_target(tmp_path, monkeypatch):
    """recipes/code-eagle3.yaml end to end on the embedded path (the 2-layer "tiny" target,
    built in seconds, on the stdlib corpus), then the saved head drafts in the engine."""
    from specdistill.eval.engine import generate
    from specdistill.models.embedded import resolve_model

    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    overrides = [
        "target.model=embedded:tiny",
        "draft.aux_layers=[0, 1]",
        "draft.vocab_size=256",
        "data.train=[embedded:code]",
        "data.eval=[embedded:code-heldout]",
        "data.max_length=48",
        "train.max_steps=6",
        "train.global_batch_size=4",
        "train.micro_batch_size=4",
        "train.save_every=3",
        "eval.every=0",
        "eval.max_sequences=8",
        f"train.output_dir={tmp_path / 'run'}",
    ]
    recipe = load_recipe(Path(__file__).parents[2] / "recipes" / "code-eagle3.yaml", overrides)
    result = Trainer.from_recipe(recipe).run()
    assert result["steps"] == 6 and len(result["alpha_depth"]) == 3
    head = Eagle3Head.from_pretrained(tmp_path / "run" / "final")
    target = LlamaForCausalLM.from_pretrained(resolve_model("embedded:tiny"))
    out = generate(target, head, [[1, 2, 3, 4]], gamma=3, max_new_tokens=8)
    reference = generate(target, None, [[1, 2, 3, 4]], max_new_tokens=8)
    assert out.sequences == reference.sequences


def test_eagle3_two_processes_match_one_process(tiny_pair, sharp_target, tmp_path):
    """DDP (gloo, 2 processes) trains the head exactly like 1 process at the same global batch:
    training goes through the wrapper's forward, so gradients are all-reduced."""
    from safetensors.torch import load_file

    one, two = tmp_path / "one", tmp_path / "two"
    extra = {"train.max_steps": 4, "loss.name": "fkl"}
    m1 = run_cli(eagle_overrides(tiny_pair, sharp_target, one, **extra), one, processes=1)
    m2 = run_cli(eagle_overrides(tiny_pair, sharp_target, two, **extra), two, processes=2)
    steps1, steps2 = [m for m in m1 if "loss" in m], [m for m in m2 if "loss" in m]
    assert len(steps1) == 4
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in steps2] == pytest.approx([m[key] for m in steps1], rel=1e-4)
    a = load_file(one / "final" / "model.safetensors")
    b = load_file(two / "final" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)
