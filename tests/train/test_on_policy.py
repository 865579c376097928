"""On-policy data (data.on_policy, train/on_policy.py): part of each batch generated on the
fly by the draft (DistillSpec / GKD) or by the target through the speculative engine."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdistill.train.config import RecipeError, load_recipe
from specdistill.train.on_policy import inverse_cdf, on_policy_slots, row_seed
from specdistill.train.trainer import Trainer
from tests.train.helpers import (
    draft_weights,
    killed_and_resumed,
    metrics,
    overrides,
    run_cli,
    without_timing,
)
from tests.train.helpers import train as train_

PROMPT = 8
ON = {"data.on_policy.fraction": 0.5, "data.on_policy.prompt_tokens": PROMPT}
FAST = {"eval.tau_prompts": 0, "eval.max_sequences": 4}  # the evaluations are not under test


def trainer(tiny_pair, out: Path, **extra) -> Trainer:
    return Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, out, **FAST, **extra)))


def train(tiny_pair, out: Path, **extra) -> Trainer:
    return train_(tiny_pair, out, **FAST, **extra)


def train_records(out: Path) -> list[dict]:
    """Training records of metrics.jsonl without the wall-clock ones."""
    records = without_timing([m for m in metrics(out) if "loss" in m])
    return [{k: v for k, v in m.items() if k != "onpolicy/gen_s"} for m in records]


def test_slots_are_evenly_spread_and_counted_from_the_fraction():
    assert on_policy_slots(8, 0.0) == set()
    assert on_policy_slots(8, 0.5) == {0, 2, 4, 6}
    assert on_policy_slots(8, 0.25) == {0, 4}
    assert on_policy_slots(8, 1.0) == set(range(8))
    assert on_policy_slots(4, 0.125) == {0}  # 0.5 rounds up
    assert row_seed(0, 1, 2) != row_seed(0, 2, 1)


def test_fraction_zero_is_the_plain_path_exactly(tiny_pair, tmp_path):
    extra = {"train.max_steps": 3}
    plain, zero = tmp_path / "plain", tmp_path / "zero"
    train(tiny_pair, plain, **extra)
    off = {**ON, "data.on_policy.fraction": 0, "data.on_policy.source": "target"}
    t = train(tiny_pair, zero, **extra, **off)
    assert t.on_policy is None
    assert train_records(zero) == train_records(plain)
    a, b = draft_weights(plain), draft_weights(zero)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_generated_rows_replace_half_the_batch_and_only_they_are_trained_on(tiny_pair, tmp_path):
    plain = trainer(tiny_pair, tmp_path / "plain")
    on = trainer(tiny_pair, tmp_path / "on", **ON)
    slots = on.on_policy.slots
    assert slots == {0, 2}  # global batch 4, micro-batches of 2
    for step in (0, 1):
        mb = on.recipe.train.micro_batch_size
        for k, (a, b) in enumerate(
            zip(plain.micro_batches(step), on.micro_batches(step), strict=True)
        ):
            for i in range(a["input_ids"].shape[0]):
                slot = k * mb + i
                valid_a, valid_b = a["attention_mask"][i].bool(), b["attention_mask"][i].bool()
                ids_a, ids_b = a["input_ids"][i][valid_a], b["input_ids"][i][valid_b]
                mask_b = b["loss_mask"][i][valid_b]
                if slot not in slots:
                    assert torch.equal(ids_a, ids_b)
                    assert torch.equal(a["loss_mask"][i][valid_a], mask_b)
                    continue
                # the prompt is the slot's own training sequence; the rest is generated
                assert torch.equal(ids_b[:PROMPT], ids_a[:PROMPT])
                assert not torch.equal(ids_b, ids_a)
                assert not mask_b[:PROMPT].any()
                assert mask_b[PROMPT:].all()
                assert PROMPT < len(ids_b) <= on.recipe.data.max_length
    stats = on.on_policy.take_metrics(on.accelerator)
    assert stats["onpolicy/tokens"] > 0 and stats["onpolicy/gen_s"] > 0
    assert on.on_policy.take_metrics(on.accelerator)["onpolicy/tokens"] == 0  # reset


def test_a_run_trains_logs_the_generation_cost_and_repeats_exactly(tiny_pair, tmp_path):
    extra = {**ON, "train.max_steps": 4, "loss.name": "lk_lambda"}
    first = train(tiny_pair, tmp_path / "a", **extra)
    train(tiny_pair, tmp_path / "b", **extra)
    records = [m for m in metrics(tmp_path / "a") if "loss" in m]
    assert len(records) == 4
    for m in records:
        assert m["onpolicy/gen_s"] > 0
        assert 0 < m["onpolicy/tokens"] <= 2 * (32 - PROMPT)  # 2 generated rows per step
        assert torch.isfinite(torch.tensor(m["loss"]))
    assert train_records(tmp_path / "a") == train_records(tmp_path / "b")  # same seed
    initial = AutoModelForCausalLM.from_pretrained(tiny_pair[1]).state_dict()
    trained = draft_weights(tmp_path / "a")
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)
    # another seed generates other rows
    other = trainer(tiny_pair, tmp_path / "c", **extra, **{"train.seed": 1})
    assert not torch.equal(
        other.micro_batches(0)[0]["input_ids"], first.micro_batches(0)[0]["input_ids"]
    )


def test_resume_after_a_kill_equals_an_uninterrupted_run(tiny_pair, tmp_path, monkeypatch):
    extra = {**ON, "train.max_steps": 6, "train.save_every": 3}
    full, killed = tmp_path / "full", tmp_path / "killed"
    train(tiny_pair, full, **extra)
    killed_and_resumed(tiny_pair, killed, monkeypatch, kill=4, **FAST, **extra)
    a, b = train_records(full), train_records(killed)
    assert [m["step"] for m in b] == list(range(1, 7))
    assert [m["onpolicy/tokens"] for m in b] == [m["onpolicy/tokens"] for m in a]
    for x, y in zip(a, b, strict=True):
        assert y == pytest.approx(x, rel=1e-5, abs=1e-7)
    wa, wb = draft_weights(full), draft_weights(killed)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-5, atol=1e-6, msg=name)


def test_draft_samples_are_the_drafts_own_distribution(tiny_pair, tmp_path):
    """The KV-cached sampling loop draws token t by inverting the CDF of the draft's
    distribution given the tokens before it, recomputed here without a cache; at
    temperature 0 it is the draft's greedy continuation (HF generate)."""
    t = trainer(tiny_pair, tmp_path / "run", **ON)
    gen, draft = t.on_policy, t.accelerator.unwrap_model(t.draft)
    prompts = [t.train_data[i]["input_ids"][:PROMPT].tolist() for i in (0, 1)]
    prompts[1] = prompts[1][:5]  # ragged prompts: left-padded in the batch
    seeds = [11, 12]
    out = gen.sample_draft(prompts, [12, 12], seeds)
    for prompt, new, seed in zip(prompts, out, seeds, strict=True):
        u = torch.rand(12, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        with torch.no_grad():
            logits = draft(input_ids=torch.tensor([prompt + new])).logits[0, :, : t.vocab_size]
        probs = logits[len(prompt) - 1 : -1].softmax(-1)
        expected = inverse_cdf(probs, u[: len(new)])
        assert expected.tolist() == new
    gen.cfg.temperature = 0.0
    greedy = gen.sample_draft(prompts[:1], [10], [0])[0]
    with torch.no_grad():
        ref = draft.generate(torch.tensor(prompts[:1]), max_new_tokens=10, do_sample=False)
    assert greedy == ref[0, PROMPT:].tolist()[: len(greedy)]


def test_source_target_generates_with_the_engine(tiny_pair, tmp_path):
    extra = {**ON, "data.on_policy.source": "target", "data.on_policy.temperature": 0}
    t = trainer(tiny_pair, tmp_path / "run", **extra, **{"train.max_steps": 2})
    batch = t.micro_batches(0)[0]
    ids = batch["input_ids"][0][batch["attention_mask"][0].bool()]
    # greedy: speculative decoding reproduces the target's own greedy continuation
    with torch.no_grad():
        ref = t.target.generate(
            ids[None, :PROMPT], max_new_tokens=len(ids) - PROMPT, do_sample=False
        )
    assert ids.tolist() == ref[0].tolist()[: len(ids)]
    assert (
        batch["loss_mask"][0][:PROMPT].sum() == 0 and batch["loss_mask"][0][PROMPT : len(ids)].all()
    )
    t.run()
    records = [m for m in metrics(tmp_path / "run") if "loss" in m]
    assert len(records) == 2 and all(m["onpolicy/tokens"] > 0 for m in records)


def test_an_eagle3_head_trains_on_the_targets_speculative_samples(tiny_pair, tmp_path):
    from tests.train.helpers import eagle_overrides

    extra = {**ON, **FAST, "data.on_policy.source": "target", "train.max_steps": 2}
    recipe = load_recipe(None, eagle_overrides(tiny_pair, tiny_pair[0], tmp_path / "run", **extra))
    t = Trainer.from_recipe(recipe)
    batch = t.micro_batches(0)[0]
    assert not batch["loss_mask"][0][:PROMPT].any() and batch["loss_mask"][0][PROMPT:].any()
    record = t.train_step(0)
    assert record["onpolicy/tokens"] > 0 and torch.isfinite(torch.tensor(record["loss"]))


def test_a_lora_draft_samples_its_own_rows(tiny_pair, tmp_path):
    t = trainer(tiny_pair, tmp_path / "run", **ON, **{"draft.lora.r": 4})
    record = t.train_step(0)
    assert record["onpolicy/tokens"] > 0 and torch.isfinite(torch.tensor(record["loss"]))


@pytest.mark.slow  # ~60 s on 2 shared cores, nearly all of it starting 3 processes
def test_two_processes_generate_and_train_as_one_process(tiny_pair, tmp_path):
    """Each process generates the rows of its own micro-batches; they are the rows one
    process generates (global slots, per-row seeds), so the run is the same."""
    one, two = tmp_path / "one", tmp_path / "two"
    extra = {**ON, **FAST, "train.max_steps": 3, "loss.name": "tv"}
    m1 = [m for m in run_cli(overrides(tiny_pair, one, **extra), one, processes=1) if "loss" in m]
    m2 = [m for m in run_cli(overrides(tiny_pair, two, **extra), two, processes=2) if "loss" in m]
    assert len(m1) == 3
    for key in ("tokens", "onpolicy/tokens"):
        assert [m[key] for m in m2] == [m[key] for m in m1], key
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in m2] == pytest.approx([m[key] for m in m1], rel=1e-4, abs=1e-6)
    a, b = draft_weights(one), draft_weights(two)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"data.on_policy.fraction": 1.5}, r"data\.on_policy\.fraction must be in \[0, 1\]"),
        ({"data.on_policy.fraction": -0.1}, r"data\.on_policy\.fraction must be in \[0, 1\]"),
        ({"data.on_policy.fractoin": 0.5}, r"did you mean 'data\.on_policy\.fraction'"),
        ({"data.on_policy.source": "student"}, r"data\.on_policy\.source must be one of draft"),
        ({"data.on_policy.fraction": 0.1}, r"rounds to 0 generated sequences"),
        ({**ON, "data.on_policy.prompt_tokens": 32}, r"prompt_tokens \(32\) must be below"),
        (
            {**ON, "draft.type": "eagle3", "draft.model": None},
            r"data\.on_policy\.source=draft needs a standalone draft",
        ),
        ({**ON, "target.cache": "somewhere"}, r"target\.cache does not hold"),
    ],
)
def test_bad_on_policy_settings_are_recipe_errors_naming_the_key(
    tiny_pair, tmp_path, extra, message
):
    with pytest.raises(RecipeError, match=message):
        load_recipe(None, overrides(tiny_pair, tmp_path / "run", **extra))


def test_a_null_prompt_length_takes_a_chat_records_prompt_and_refuses_plain_text(
    tiny_pair, tmp_path
):
    from specdistill.train.on_policy import prompt_of

    ids = torch.arange(10)
    chat = torch.tensor([False] * 6 + [True] * 4)  # the prompt, then the assistant's reply
    assert prompt_of(ids, chat, None, 10) == list(range(6))
    assert prompt_of(ids, chat, 3, 10) == [0, 1, 2]
    # a chat truncated inside its prompt: all but one token of max_length, one generated
    assert prompt_of(ids, torch.zeros(10, dtype=torch.bool), None, 10) == list(range(9))
    text = torch.tensor([False] + [True] * 9)  # loss_mask[0] is never set
    with pytest.raises(RecipeError, match="prompt_tokens is null"):
        prompt_of(ids, text, None, 10)
    t = trainer(tiny_pair, tmp_path / "run", **{**ON, "data.on_policy.prompt_tokens": "null"})
    with pytest.raises(RecipeError, match="plain text"):
        t.micro_batches(0)
