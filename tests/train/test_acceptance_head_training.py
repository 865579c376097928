"""The acceptance head trained with the draft (train/head_training.py, train/step.py): the
draft trains bit-identically with and without it (stop_gradient), the head alone on a
frozen draft (train.only=acceptance_head), its state in checkpoints and an exact resume, the
head saved in final/ and best/, its calibration in eval.json, and the recipe checks."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdistill.drafts.acceptance_head import CONFIG, WEIGHTS, load_acceptance_head
from specdistill.drafts.loader import load_draft
from specdistill.train.config import RecipeError, load_recipe
from specdistill.train.trainer import Trainer
from tests.train.helpers import Killed, metrics, overrides, run_cli

HEAD = {"acceptance_head.enabled": "true"}


def run(tiny_pair, out: Path, **extra) -> dict:
    return Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, out, **extra))).run()


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


def head_weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / WEIGHTS)


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_the_head_leaves_the_draft_bit_identical_and_is_saved(tiny_pair, tmp_path, capsys):
    extra = {"train.max_steps": 4, "loss.name": "lk_lambda"}
    plain, head = tmp_path / "plain", tmp_path / "head"
    run(tiny_pair, plain, **extra)
    result = run(tiny_pair, head, **extra, **HEAD)
    assert_same(weights(plain / "final"), weights(head / "final"))
    # the same metrics, and head_loss only with the head
    a = [m for m in metrics(plain) if "loss" in m]
    b = [m for m in metrics(head) if "loss" in m]
    for key in ("loss", "alpha", "grad_norm", "lr", "tokens"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    assert not any("head_loss" in m for m in a)
    assert all(m["head_loss"] > 0 for m in b)
    assert b[-1]["head_loss"] < b[0]["head_loss"]
    # the same held-out numbers
    plain_report = json.loads((plain / "eval.json").read_text())
    report = json.loads((head / "eval.json").read_text())
    for key in ("alpha", "alpha_greedy", "alpha_before", "tau_pred"):
        assert report[key] == plain_report[key], key
    assert "acceptance_head" not in plain_report
    # the head in final/, loaded with the draft, labelled at eval.temperature
    assert not (plain / "final" / WEIGHTS).exists()
    for name in ("final", "best"):
        assert (head / name / WEIGHTS).is_file() and (head / name / CONFIG).is_file()
    loaded = load_draft(str(head / "final"))
    assert loaded.acceptance_head.config.temperature == 1.0
    # calibration in eval.json and on the console
    entry = report["acceptance_head"]
    assert entry == result["acceptance_head"]
    assert 0 <= entry["ece"] <= 1 and entry["n"] > 0
    assert sum(b["count"] for b in entry["bins"]) == entry["n"]
    assert entry["reliability_png"] == "acceptance_head_reliability.png"
    assert (head / entry["reliability_png"]).read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert f"acceptance head: ECE {entry['ece']:.3f} on {entry['n']} held-out positions" in out


def test_the_head_trains_towards_its_label(tiny_pair, tmp_path):
    """A trained head is better calibrated than the untrained one (a constant prior)."""
    out = tmp_path / "run"
    extra = {"train.max_steps": 30, "acceptance_head.lr": 1e-2, **HEAD}
    run(tiny_pair, out, **extra)
    trained = json.loads((out / "eval.json").read_text())["acceptance_head"]["ece"]
    untrained = tmp_path / "untrained"
    run(tiny_pair, untrained, **{**extra, "train.max_steps": 1, "acceptance_head.lr": 1e-9})
    prior = json.loads((untrained / "eval.json").read_text())["acceptance_head"]["ece"]
    assert trained < prior


def test_only_the_head_trains_on_a_frozen_draft(tiny_pair, tmp_path):
    draft = tiny_pair[1]
    out = tmp_path / "only"
    extra = {"train.max_steps": 3, **HEAD, "train.only": "acceptance_head"}
    result = run(tiny_pair, out, **extra)
    assert_same(weights(draft), weights(out / "final"))
    assert result["alpha"] == result["alpha_before"]
    assert result["trainable_params"] == 0
    assert (out / "final" / WEIGHTS).is_file()
    records = [m for m in metrics(out) if "loss" in m]
    assert all(m["head_loss"] > 0 and m["grad_norm"] > 0 for m in records)
    # a second add-on run on that draft starts from its head
    again = tmp_path / "again"
    run(tiny_pair, again, **{**extra, "draft.model": str(out / "final"), "train.max_steps": 1})
    first = load_acceptance_head(out / "final")
    second = load_acceptance_head(again / "final")
    assert not torch.equal(first.fc2.weight, torch.zeros_like(first.fc2.weight))
    assert not torch.equal(first.fc1.weight, second.fc1.weight)  # trained one step further
    assert_same(weights(out / "final"), weights(again / "final"))


def test_resume_restores_the_head_exactly(tiny_pair, tmp_path, monkeypatch):
    extra = {"train.max_steps": 8, "train.save_every": 4, "loss.name": "lk_lambda", **HEAD}
    full, killed = tmp_path / "full", tmp_path / "killed"
    run(tiny_pair, full, **extra)
    original = Trainer.train_step

    def dies_at_step_6(self, step):
        if step == 6:
            raise Killed
        return original(self, step)

    monkeypatch.setattr(Trainer, "train_step", dies_at_step_6)
    with pytest.raises(Killed):
        run(tiny_pair, killed, **extra)
    monkeypatch.setattr(Trainer, "train_step", original)
    run(tiny_pair, killed, **extra, **{"train.resume": "auto"})
    for name in ("model.safetensors", WEIGHTS):
        a, b = load_file(full / "final" / name), load_file(killed / "final" / name)
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
    head_loss = {m["step"]: m["head_loss"] for m in metrics(killed) if "loss" in m}
    full_loss = [m["head_loss"] for m in metrics(full) if "loss" in m]
    assert [head_loss[s] for s in range(1, 9)] == pytest.approx(full_loss, rel=1e-5)


def test_the_chunked_path_trains_the_head_like_the_direct_one(tiny_pair, tmp_path):
    extra = {"train.max_steps": 3, "loss.name": "lk_lambda", **HEAD}
    direct, chunked = tmp_path / "direct", tmp_path / "chunked"
    run(tiny_pair, direct, **extra)
    run(tiny_pair, chunked, **extra, **{"loss.chunk_size": 7})
    a = [m["head_loss"] for m in metrics(direct) if "loss" in m]
    b = [m["head_loss"] for m in metrics(chunked) if "loss" in m]
    assert b == pytest.approx(a, rel=1e-4)
    for key, w in head_weights(direct / "final").items():
        torch.testing.assert_close(head_weights(chunked / "final")[key], w, rtol=1e-4, atol=1e-5)


def test_without_stop_gradient_the_head_trains_the_draft_too(tiny_pair, tmp_path):
    extra = {"train.max_steps": 2, "loss.name": "lk_lambda"}
    plain, joint = tmp_path / "plain", tmp_path / "joint"
    run(tiny_pair, plain, **extra)
    run(tiny_pair, joint, **extra, **HEAD, **{"acceptance_head.stop_gradient": "false"})
    a, b = weights(plain / "final"), weights(joint / "final")
    assert any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"train.only": "acceptance_head"}, "set acceptance_head.enabled=true"),
        ({**HEAD, "train.only": "acceptance_head", "draft.lora.r": 4}, "unset draft.lora.r"),
        ({**HEAD, "target.cache": "somewhere", "eval.temperature": 0}, "set eval.temperature=1"),
        ({**HEAD, "acceptance_head.stop_gradient": "false", "loss.chunk_size": 8}, "chunk_size"),
        ({"train.only": "draft"}, "train.only"),
    ],
)
def test_recipe_checks(tiny_pair, tmp_path, extra, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(None, overrides(tiny_pair, tmp_path / "run", **extra))


def assert_trained_beside(plain: Path, head: Path) -> None:
    """The run with a head left the draft as the run without it did, and saved, calibrated and
    trained the head (its loss logged at every step)."""
    assert_same(weights(plain / "final"), weights(head / "final"))
    loaded = load_draft(str(head / "final"))
    assert loaded.acceptance_head.config.hidden_size == loaded.config.hidden_size
    report = json.loads((head / "eval.json").read_text())["acceptance_head"]
    assert report["n"] > 0
    assert all(m["head_loss"] > 0 for m in metrics(head) if "loss" in m)


def test_an_eagle3_head_trains_its_acceptance_head_at_every_depth(tiny_pair, tmp_path):
    from tests.train.helpers import eagle_overrides

    extra = {"train.max_steps": 3, "draft.aux_layers": "[0]"}
    plain, head = tmp_path / "plain", tmp_path / "head"
    target = tiny_pair[0]
    for out, more in ((plain, {}), (head, HEAD)):
        recipe = load_recipe(None, eagle_overrides(tiny_pair, target, out, **extra, **more))
        Trainer.from_recipe(recipe).run()
    assert_trained_beside(plain, head)


def test_a_saved_head_stays_attached_untrained_when_the_head_is_off(tiny_pair, tmp_path):
    """The online job's path: a step core on a draft directory that holds a head, with
    acceptance_head off, publishes (the draft type's save of its draft module) that head."""
    import shutil

    from accelerate import Accelerator

    from specdistill import drafts
    from specdistill.drafts.acceptance_head import (
        AcceptanceHead,
        AcceptanceHeadConfig,
        save_acceptance_head,
    )
    from specdistill.models import hub
    from specdistill.train.step import DistillStep

    target_dir, draft_dir, _ = tiny_pair
    with_head = tmp_path / "draft"
    shutil.copytree(draft_dir, with_head)
    recipe = load_recipe(
        None, overrides(tiny_pair, tmp_path / "run", **{"draft.model": str(with_head)})
    )
    tokenizer = hub.load_tokenizer(str(target_dir))
    target = hub.load_target(str(target_dir), None)
    draft, kind = drafts.build(recipe.draft, target, tokenizer, None, print=lambda *a: None)
    save_acceptance_head(
        AcceptanceHead(AcceptanceHeadConfig.for_draft(draft, prior=0.3)), with_head
    )
    core = DistillStep(
        recipe, accelerator=Accelerator(cpu=True), target=target, draft=draft, kind=kind
    )
    assert core.head_training is None and core.head is not None
    kind.save(core.draft_module(), tmp_path / "published", tokenizer, verifier=str(target_dir))
    assert_same(head_weights(with_head), head_weights(tmp_path / "published"))


def test_two_processes_train_the_head_as_one_process(tiny_pair, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    extra = {"train.max_steps": 3, "loss.name": "tv", **HEAD}
    m1 = run_cli(overrides(tiny_pair, one, **extra), one, processes=1)
    m2 = run_cli(overrides(tiny_pair, two, **extra), two, processes=2)
    loss1 = [m["head_loss"] for m in m1 if "loss" in m]
    loss2 = [m["head_loss"] for m in m2 if "loss" in m]
    assert len(loss1) == 3 and loss2 == pytest.approx(loss1, rel=1e-4, abs=1e-6)
    a, b = head_weights(one / "final"), head_weights(two / "final")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)


def test_a_lora_draft_is_saved_merged_with_its_head(tiny_pair, tmp_path):
    out = tmp_path / "lora"
    run(tiny_pair, out, **{"train.max_steps": 2, "draft.lora.r": 4, **HEAD})
    loaded = load_draft(str(out / "final"))
    assert loaded.acceptance_head is not None
    assert not any("lora" in name for name in weights(out / "final"))


def test_a_parallel_draft_trains_its_acceptance_head_at_every_depth(tiny_pair, tmp_path):
    extra = {"train.max_steps": 3, "draft.type": "parallel", "draft.parallel_depths": 3}
    plain, head = tmp_path / "plain", tmp_path / "head"
    for out, more in ((plain, {}), (head, HEAD)):
        Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, out, **extra, **more))).run()
    assert_trained_beside(plain, head)
