import json

import pytest
import torch

from specdistill.models.hub import TokenizerMismatchError, check_tokenizers, load_tokenizer
from specdistill.train.config import load_recipe
from specdistill.train.trainer import Trainer
from tests.train.helpers import Killed, draft_weights, metrics, overrides, run_cli


def test_distillation_raises_alpha_and_writes_outputs(tiny_pair, tmp_path):
    out = tmp_path / "run"
    recipe = load_recipe(None, overrides(tiny_pair, out, **{"train.max_steps": 30}))
    result = Trainer.from_recipe(recipe).run()
    assert result["alpha"] > result["alpha_before"] + 0.02
    report = json.loads((out / "eval.json").read_text())
    for key in ("alpha", "alpha_greedy", "alpha_before", "tau_pred", "steps"):
        assert key in report
    assert report["steps"] == 30
    assert set(report["tau_pred"]) == {str(g) for g in range(1, 9)}
    assert 1.0 <= report["tau_pred"]["5"] <= 6.0
    # tau_pred replays rounds along the target's own texts (issue 15), generated once and kept
    # for a resume; the i.i.d. value stays as tau_pred_iid.
    assert set(report["tau_pred_iid"]) == set(report["tau_pred"])
    texts = json.loads((out / "tau_texts.json").read_text())
    assert len(texts["outputs"]) == len(texts["prompts"]) >= 1
    assert all(len(o) == 64 for o in texts["outputs"])
    assert any(f"eval/tau_pred_iid_{g}" in m for m in metrics(out) for g in (5,))
    assert load_recipe(out / "recipe.yaml") == recipe
    train_records = [m for m in metrics(out) if "loss" in m]
    assert [m["step"] for m in train_records] == list(range(1, 31))
    assert train_records[-1]["loss"] < train_records[0]["loss"]
    # the final draft is an ordinary HF directory with its tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(out / "final")
    assert len(AutoTokenizer.from_pretrained(out / "final")) == 320


def test_tokenizer_mismatch_is_an_error_before_training(tiny_pair, other_tokenizer_draft, tmp_path):
    target = tiny_pair[0]
    with pytest.raises(
        TokenizerMismatchError, match="do not share a tokenizer: vocabularies differ"
    ):
        check_tokenizers(
            load_tokenizer(str(target)), load_tokenizer(str(other_tokenizer_draft)), "t", "d"
        )
    recipe = load_recipe(
        None, overrides(tiny_pair, tmp_path / "run", **{"draft.model": str(other_tokenizer_draft)})
    )
    with pytest.raises(TokenizerMismatchError):
        Trainer.from_recipe(recipe)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_resume_gives_the_same_draft_as_an_uninterrupted_run(tiny_pair, tmp_path, monkeypatch):
    extra = {"train.max_steps": 10, "train.save_every": 4, "loss.name": "lk_lambda"}
    full = tmp_path / "full"
    Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, full, **extra))).run()

    killed = tmp_path / "killed"
    original = Trainer.train_step

    def dies_at_step_6(self, step):
        if step == 6:
            raise Killed
        return original(self, step)

    monkeypatch.setattr(Trainer, "train_step", dies_at_step_6)
    with pytest.raises(Killed):
        Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, killed, **extra))).run()
    monkeypatch.setattr(Trainer, "train_step", original)
    assert [p.name for p in (killed / "checkpoints").iterdir()] == ["step-0000004"]

    resumed = Trainer.from_recipe(
        load_recipe(None, overrides(tiny_pair, killed, **extra, **{"train.resume": "auto"}))
    )
    resumed.run()
    assert resumed.step == 10
    a, b = draft_weights(full), draft_weights(killed)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
    full_loss = [m["loss"] for m in metrics(full) if "loss" in m]
    # the killed run logged steps 1..6, the resumed one 5..10 (later lines win)
    resumed_loss = {m["step"]: m["loss"] for m in metrics(killed) if "loss" in m}
    assert [resumed_loss[s] for s in range(1, 11)] == pytest.approx(full_loss, rel=1e-5)


def test_two_processes_match_one_process_at_equal_global_batch(tiny_pair, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    extra = {"train.max_steps": 6, "loss.name": "tv"}
    m1 = run_cli(overrides(tiny_pair, one, **extra), one, processes=1)
    m2 = run_cli(overrides(tiny_pair, two, **extra), two, processes=2)
    loss1 = [m["loss"] for m in m1 if "loss" in m]
    loss2 = [m["loss"] for m in m2 if "loss" in m]
    assert len(loss1) == 6
    assert loss2 == pytest.approx(loss1, rel=1e-4, abs=1e-6)
    assert [m["tokens"] for m in m2 if "loss" in m] == [m["tokens"] for m in m1 if "loss" in m]
    # Adam hides a constant gradient scale from the weights: compare the gradient itself
    grad1 = [m["grad_norm"] for m in m1 if "loss" in m]
    grad2 = [m["grad_norm"] for m in m2 if "loss" in m]
    assert grad2 == pytest.approx(grad1, rel=1e-4)
    a, b = draft_weights(one), draft_weights(two)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)


def test_chunked_loss_trains_exactly_like_the_direct_loss(tiny_pair, tmp_path):
    extra = {"train.max_steps": 4, "loss.name": "lk_lambda"}
    direct, chunked = tmp_path / "direct", tmp_path / "chunked"
    Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, direct, **extra))).run()
    Trainer.from_recipe(
        load_recipe(None, overrides(tiny_pair, chunked, **extra, **{"loss.chunk_size": 7}))
    ).run()
    a = [m for m in metrics(direct) if "loss" in m]
    b = [m for m in metrics(chunked) if "loss" in m]
    for key in ("loss", "alpha", "grad_norm"):
        assert [m[key] for m in b] == pytest.approx([m[key] for m in a], rel=1e-4), key
    for name, w in draft_weights(direct).items():
        torch.testing.assert_close(draft_weights(chunked)[name], w, rtol=1e-4, atol=1e-5, msg=name)


def test_periodic_speculative_eval_logs_measured_tau(tiny_pair, tmp_path):
    out = tmp_path / "run"
    extra = {
        "train.max_steps": 4,
        "eval.speculative.every": 2,
        "eval.speculative.gammas": "[1, 3]",
        "eval.speculative.prompts": 2,
        "eval.speculative.prompt_tokens": 8,
        "eval.speculative.max_new_tokens": 8,
        "eval.temperature": 0,
    }
    result = Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, out, **extra))).run()
    spec = [m for m in metrics(out) if "spec/best_gamma" in m]
    assert [m["step"] for m in spec] == [2, 4]
    for m in spec:
        assert m["spec/best_gamma"] in (1, 3)
        for g in (1, 3):
            assert 1.0 <= m[f"spec/tau_{g}"] <= g + 1
            assert m[f"spec/speedup_{g}"] > 0
    assert result["speculative"]["step"] == 4


def test_threads_are_chosen_at_the_start_and_rechecked_between_steps(
    tiny_pair, tmp_path, monkeypatch, capsys
):
    """train.threads null: the free cores at the start, re-checked after every step; a
    forced train.threads is said and kept (specdistill/threads.py)."""
    from specdistill.threads import ThreadPolicy

    calls = []
    monkeypatch.setattr(ThreadPolicy, "recheck", lambda self, say=None: calls.append(say))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # else a forced count
    out = tmp_path / "run"
    Trainer.from_recipe(
        load_recipe(None, overrides(tiny_pair, out, **{"train.max_steps": 3}))
    ).run()
    assert len(calls) == 3
    assert "threads: " in capsys.readouterr().out
    forced = tmp_path / "forced"
    Trainer.from_recipe(
        load_recipe(
            None, overrides(tiny_pair, forced, **{"train.max_steps": 1, "train.threads": 1})
        )
    ).run()
    assert "threads: 1 (train.threads)" in capsys.readouterr().out
