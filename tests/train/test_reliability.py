"""The trainer's run lifecycle (docs/reliability.md): what happens around a run rather than in
it. A rerun into a used output_dir, a resume with another recipe or a bad path, a kill at a
checkpoint or during the final save, a damaged checkpoint, and what the console and the
metrics log show afterwards. Each test failed before the behaviour it checks was fixed.
"""

import ast
import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from specdistill import publish
from specdistill.models import hub
from specdistill.train.config import RecipeError, load_recipe
from specdistill.train.distill import main as distill_main
from specdistill.train.run_plan import CheckpointError, TiedHeadWarningFilter
from specdistill.train.trainer import Trainer
from tests.train.helpers import (
    Killed,
    draft_weights,
    kill_at,
    killed_and_resumed,
    metrics,
    overrides,
    train,
    without_timing,
)

REPO = Path(__file__).parents[2]


def snapshot(out: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `out`: (content, mtime), to show that nothing was rewritten."""
    return {
        str(p.relative_to(out)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


# 1: a used output_dir ------------------------------------------------------------------------


def test_a_used_output_dir_is_refused_unless_resuming_or_overwriting(tiny_pair, tmp_path):
    out = tmp_path / "run"
    train(tiny_pair, out, **{"train.max_steps": 3})
    before = snapshot(out)
    with pytest.raises(RecipeError) as error:
        train(tiny_pair, out, **{"train.max_steps": 3, "loss.name": "tv"})
    assert "train.resume=auto" in str(error.value)
    assert "train.overwrite=true" in str(error.value)
    assert snapshot(out) == before

    train(tiny_pair, out, **{"train.max_steps": 3, "loss.name": "tv", "train.overwrite": "true"})
    assert load_recipe(out / "recipe.yaml").loss.name == "tv"
    assert [m["step"] for m in metrics(out) if "loss" in m] == [1, 2, 3]  # one run's records
    assert json.loads((out / "eval.json").read_text())["loss"] == "tv"


def test_the_readme_recipe_run_twice_reports_the_finished_run(
    tiny_pair, tmp_path, monkeypatch, capsys
):
    """`train/distill.py --recipe recipes/code.yaml` a second time: the shipped recipes say
    train.resume=auto, so the rerun finds the finished run, prints its result and exits 0
    without loading a model or rewriting a file."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("code.yaml", "code-eagle3.yaml"):
        assert load_recipe(REPO / "recipes" / name).train.resume == "auto"
    out = tmp_path / "run"
    args = [
        "--recipe",
        str(REPO / "recipes" / "code.yaml"),
        *overrides(tiny_pair, out, **{"train.max_steps": 4, "train.save_every": 2}),
        "data.eval=null",
    ]
    assert distill_main(args) == 0
    first = capsys.readouterr().out
    before = snapshot(out)

    def no_loading(*args, **kwargs):
        raise AssertionError("a finished run loaded a model")

    monkeypatch.setattr(hub, "load_model", no_loading)
    monkeypatch.setattr(hub, "load_tokenizer", no_loading)
    assert distill_main(args) == 0
    second = capsys.readouterr().out
    assert "already holds the finished run" in second
    after_line = [line for line in first.splitlines() if line.startswith("alpha after:")]
    assert after_line and after_line[0] in second.splitlines()
    assert snapshot(out) == before


# 2: resume=auto with another recipe ----------------------------------------------------------


def test_resume_refuses_a_recipe_that_changes_the_result(tiny_pair, tmp_path, capsys):
    out = tmp_path / "run"
    base = {"train.max_steps": 4, "train.save_every": 2}
    train(tiny_pair, out, **base)
    auto = {**base, "train.resume": "auto"}
    with pytest.raises(RecipeError) as error:
        train(tiny_pair, out, **{**auto, "loss.name": "tv", "train.lr": 0.01})
    message = str(error.value)
    assert "loss.name: fkl → tv" in message and "train.lr: 0.003 → 0.01" in message
    with pytest.raises(RecipeError, match="train.seed: 0 → 1"):
        train(tiny_pair, out, **{**auto, "train.seed": 1})
    with pytest.raises(RecipeError, match="train.max_steps: 4 → 2"):
        train(tiny_pair, out, **{**auto, "train.max_steps": 2})

    capsys.readouterr()
    more = {"train.max_steps": 6, "eval.every": 5, "train.keep_checkpoints": 3}
    trainer = train(tiny_pair, out, **{**auto, **more})
    assert trainer.step == 6
    printed = capsys.readouterr().out
    changes = ("train.max_steps: 4 → 6", "eval.every: 0 → 5", "train.keep_checkpoints: 2 → 3")
    for change in changes:
        assert change in printed


# 3: validation before any model load -------------------------------------------------------


def test_a_bad_resume_is_refused_before_loading_and_writes_nothing(
    tiny_pair, tmp_path, monkeypatch
):
    out = tmp_path / "run"
    base = {"train.max_steps": 2, "train.save_every": 2}
    train(tiny_pair, out, **base)
    before = snapshot(out)

    def no_loading(*args, **kwargs):
        raise AssertionError("loaded a model before validating the output_dir")

    monkeypatch.setattr(hub, "load_model", no_loading)
    monkeypatch.setattr(hub, "load_tokenizer", no_loading)
    bad = [
        ({"train.resume": str(tmp_path / "nowhere")}, "is not a checkpoint directory"),
        ({"train.resume": str(out)}, "is not a checkpoint directory"),  # the run, not a step
        ({"train.resume": "auto", "loss.name": "tv"}, "loss.name: fkl → tv"),
        ({}, "not empty"),  # train.resume=no
        (
            {"train.resume": str(out / "checkpoints" / "step-0000002"), "train.overwrite": "true"},
            "would delete train.resume",
        ),
    ]
    for extra, message in bad:
        with pytest.raises(RecipeError, match=message):
            Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, out, **base, **extra)))
        assert snapshot(out) == before


# 4: the metrics log of a resumed run --------------------------------------------------------


@pytest.mark.parametrize("offset", [True, False], ids=["byte-offset", "by-step"])
def test_resumed_metrics_log_equals_an_uninterrupted_runs(tiny_pair, tmp_path, monkeypatch, offset):
    extra = {"train.max_steps": 8, "train.save_every": 4, "eval.every": 3}
    full = tmp_path / "full"
    train(tiny_pair, full, **extra)

    killed = tmp_path / "killed"
    with monkeypatch.context() as m:
        kill_at(m, 6)
        with pytest.raises(Killed):
            train(tiny_pair, killed, **extra)
    if not offset:  # a checkpoint written before the offset was stored: filtered by step
        state_file = killed / "checkpoints" / "step-0000004" / "trainer_state.json"
        state = json.loads(state_file.read_text())
        state.pop("metrics_bytes", None)
        state_file.write_text(json.dumps(state))
    train(tiny_pair, killed, **extra, **{"train.resume": "auto"})

    a, b = without_timing(metrics(full)), without_timing(metrics(killed))
    assert [(m["step"], sorted(m)) for m in b] == [(m["step"], sorted(m)) for m in a]
    for x, y in zip(a, b, strict=True):
        assert y == pytest.approx(x, rel=1e-5, abs=1e-7)


def test_a_run_killed_before_its_first_checkpoint_restarts_cleanly(
    tiny_pair, tmp_path, monkeypatch
):
    extra = {"train.max_steps": 4, "train.save_every": 4}
    full = tmp_path / "full"
    train(tiny_pair, full, **extra)
    resumed = killed_and_resumed(tiny_pair, tmp_path / "run", monkeypatch, kill=2, **extra)
    assert resumed.step == 4
    a, b = without_timing(metrics(full)), without_timing(metrics(tmp_path / "run"))
    assert [m["step"] for m in b] == [m["step"] for m in a]  # the killed attempt's log is gone


# 5: a kill during the final save -------------------------------------------------------------


def test_a_failed_final_save_leaves_no_final_and_no_eval_json(tiny_pair, tmp_path):
    out = tmp_path / "run"
    extra = {"train.max_steps": 4, "train.save_every": 4}
    trainer = Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, out, **extra)))

    def dies_midway(*args, **kwargs):  # the draft's weights are written, the tokenizer not
        raise Killed

    trainer.tokenizer.save_pretrained = dies_midway
    with pytest.raises(Killed):
        trainer.run()
    assert not (out / "final").exists()
    assert not (out / "eval.json").exists()

    result = train(tiny_pair, out, **extra, **{"train.resume": "auto"})
    assert result.step == 4
    assert json.loads((out / "eval.json").read_text())["steps"] == 4
    AutoModelForCausalLM.from_pretrained(out / "final")
    AutoTokenizer.from_pretrained(out / "final")
    assert [m["step"] for m in metrics(out) if "eval/alpha" in m] == [0, 4]  # logged once each
    assert sorted(p.name for p in out.iterdir()) == [
        "best",  # the final evaluation is the only one, so it is the best
        "checkpoints",
        "eval.json",
        "final",
        "metrics.jsonl",
        "recipe.yaml",
        "tau_texts.json",  # the target's held-out texts tau_pred replays rounds along
    ]


# 6: a damaged checkpoint ------------------------------------------------------------------------


def test_a_damaged_checkpoint_falls_back_to_the_previous_one(
    tiny_pair, tmp_path, monkeypatch, capsys
):
    extra = {"train.max_steps": 10, "train.save_every": 4}
    full = tmp_path / "full"
    train(tiny_pair, full, **extra)

    synced = []
    original_fsync = publish.fsync_path
    monkeypatch.setattr(publish, "fsync_path", lambda p: synced.append(str(p)) or original_fsync(p))
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        kill_at(m, 9)
        with pytest.raises(Killed):
            train(tiny_pair, out, **extra)
    # each checkpoint file, then the directory holding the new name, reached the disk
    assert any(p.endswith(".tmp-step-0000008/model.safetensors") for p in synced)
    assert str(out / "checkpoints") in synced

    newest = out / "checkpoints" / "step-0000008" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:1000])  # a crash cut it short
    capsys.readouterr()
    resumed = train(tiny_pair, out, **extra, **{"train.resume": "auto"})
    err = capsys.readouterr().err
    assert "cannot load checkpoint" in err and "step-0000008" in err
    assert "previous complete checkpoint" in err and "step-0000004" in err
    assert resumed.step == 10
    a, b = draft_weights(full), draft_weights(out)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)

    for step in ("step-0000004", "step-0000008"):  # none loads: an error naming both
        path = out / "checkpoints" / step / "model.safetensors"
        path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError) as error:
        train(tiny_pair, out, **{**extra, "train.max_steps": 12, "train.resume": "auto"})
    assert "step-0000004" in str(error.value) and "step-0000008" in str(error.value)


# 8: the console summary after a resume ------------------------------------------------------


def test_resumed_summary_prints_tau_pred_before(tiny_pair, tmp_path, monkeypatch, capsys):
    extra = {"train.max_steps": 6, "train.save_every": 3}
    resumed = killed_and_resumed(tiny_pair, tmp_path / "run", monkeypatch, kill=4, **extra)
    tau = resumed.alpha_before["tau_pred"]
    assert set(tau) == set(range(1, 9))  # int keys again after the JSON round trip
    summary = [line for line in capsys.readouterr().out.splitlines() if "tau_pred" in line]
    assert summary and f"tau_pred(gamma=5) {tau[5]:.3f} -> " in summary[-1]


# log hygiene ------------------------------------------------------------------------------------


@pytest.fixture
def tied_tiny_draft(tiny_pair, tmp_path) -> Path:
    """The tiny draft with its output head tied to its input embeddings."""
    draft = tiny_pair[1]
    config = AutoConfig.from_pretrained(draft, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    path = tmp_path / "tied"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(draft).save_pretrained(path)
    return path


def test_a_tied_draft_checkpoints_without_the_shared_tensor_warning(
    tiny_pair, tied_tiny_draft, tmp_path, caplog, capsys
):
    caplog.set_level(logging.WARNING)
    extra = {"draft.model": str(tied_tiny_draft), "train.max_steps": 2, "train.save_every": 1}
    train(tiny_pair, tmp_path / "run", **extra)
    assert (tmp_path / "run" / "checkpoints" / "step-0000002").is_dir()
    captured = capsys.readouterr()
    for text in (caplog.text, captured.out, captured.err):
        assert "Removed shared tensor" not in text
    # only the known-harmless case is dropped: another shared tensor still warns
    names = {"lm_head.weight", "module.lm_head.weight"}
    quiet = TiedHeadWarningFilter(names)

    def record(removed: set) -> logging.LogRecord:
        message = f"[RANK 0] Removed shared tensor {removed} while saving. This should be OK"
        return logging.LogRecord("accelerate", logging.WARNING, "", 0, message, (), None)

    assert not quiet.filter(record({"lm_head.weight"}))
    assert quiet.filter(record({"model.layers.0.mlp.up_proj.weight"}))


def test_a_log_that_is_not_a_terminal_gets_plain_progress_lines(tiny_pair, tmp_path, capsys):
    capsys.readouterr()
    train(tiny_pair, tmp_path / "run", **{"train.max_steps": 4, "train.log_every": 2})
    captured = capsys.readouterr()
    assert "\r" not in captured.out and "\r" not in captured.err
    lines = [line for line in captured.out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 2/4", "step 4/4"]
    assert all(" | loss " in line and " | alpha " in line and " | lr " in line for line in lines)


# the publish helpers ------------------------------------------------------------------------------


def test_publish_replaces_atomically_and_imports_only_the_standard_library(tmp_path):
    final = tmp_path / "final"
    for version in ("old", "new"):
        tmp = tmp_path / f".tmp-{version}"
        tmp.mkdir()
        (tmp / "weights").write_text(version)
        publish.publish_dir(tmp, final)
    assert (final / "weights").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no .tmp-*, no .old-*

    report = tmp_path / "eval.json"
    publish.atomic_write_text(report, "{}")

    with pytest.raises(TypeError):
        publish.atomic_write_text(report, b"not text")  # fails while writing the temp file
    assert report.read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json", "final"]

    tree = ast.parse(Path(publish.__file__).read_text())
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported <= {"collections", "contextlib", "fcntl", "os", "shutil", "tempfile", "pathlib"}


# best/: the checkpoint chosen by held-out α ---------------------------------------------------


def scripted_alpha(monkeypatch, alphas: list[float]) -> dict[int, dict]:
    """Make successive evaluations report `alphas` (the rest of each evaluation is real) and
    record the draft's weights at each: {step: state dict}."""
    real, values, weights = Trainer.evaluate, iter(alphas), {}

    def evaluate(self):
        metrics = real(self)
        metrics["alpha"] = next(values)
        draft = self.accelerator.unwrap_model(self.draft)
        weights[self.step] = {k: v.detach().clone() for k, v in draft.state_dict().items()}
        return metrics

    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    return weights


def best_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "best" / "model.safetensors")


@pytest.mark.parametrize(
    "alphas, best_step",
    [([0.1, 0.5, 0.7, 0.6], 4), ([0.1, 0.5, 0.4, 0.8], 6)],
    ids=["mid-run", "final"],
)
def test_best_is_the_draft_of_the_highest_held_out_alpha(
    tiny_pair, tmp_path, monkeypatch, alphas, best_step
):
    out = tmp_path / "run"
    weights = scripted_alpha(monkeypatch, alphas)  # evaluations at steps 0, 2, 4 and 6
    result = train(tiny_pair, out, **{"train.max_steps": 6, "eval.every": 2})
    report = json.loads((out / "eval.json").read_text())
    assert report["best"]["step"] == best_step == result.best["step"]
    assert report["best"]["alpha"] == max(alphas[1:])
    assert report["alpha"] == alphas[-1]
    saved = best_weights(out)
    for name, tensor in weights[best_step].items():
        if name in saved:
            torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0)
    changed = [
        n for n in saved if not torch.equal(saved[n], weights[6 if best_step == 4 else 4][n])
    ]
    assert changed  # best/ is not just whichever draft was saved last


def test_best_survives_a_resume(tiny_pair, tmp_path, monkeypatch):
    out = tmp_path / "run"
    extra = {"train.max_steps": 6, "eval.every": 2, "train.save_every": 2}
    with monkeypatch.context() as m:
        scripted_alpha(m, [0.1, 0.9, 0.2])  # the best (step 2) is in the checkpoint at step 4
        kill_at(m, 4)
        with pytest.raises(Killed):
            train(tiny_pair, out, **extra)
    scripted_alpha(monkeypatch, [0.3])  # after the resume, from step 4: the final evaluation
    trainer = train(tiny_pair, out, **extra, **{"train.resume": "auto"})
    assert trainer.best["step"] == 2 and trainer.best["alpha"] == 0.9
    assert json.loads((out / "eval.json").read_text())["best"]["step"] == 2
