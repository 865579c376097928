"""Trainer runs for the training tests: recipe overrides on the tiny pair (a standalone draft
or an EAGLE-3 head), a run's metrics log and final weights, the training CLI in one or two
processes, a run killed before a step and its resume, and the one `error:` line of a refused
command."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdistill.train.config import load_recipe
from specdistill.train.trainer import Trainer
from tests.processes import free_port, run_bounded, why_failed

REPO = Path(__file__).parents[2]


def loss_parts(trainer: Trainer, batch: dict):
    """(loss sum, α sum, acceptance-head loss sum or None, gradients by parameter name) of one
    micro-batch through the trainer's step core, after a backward of both losses."""
    trainer.draft.zero_grad(set_to_none=True)
    parts = trainer.core.losses(batch)
    total = parts.loss_sum + (0 if parts.head is None else parts.head.loss_sum)
    total.backward()
    grads = {n: p.grad.clone() for n, p in trainer.draft.named_parameters() if p.grad is not None}
    head = None if parts.head is None else float(parts.head.loss_sum.detach())
    return float(parts.loss_sum.detach()), float(parts.alpha_sum), head, grads


def assert_trains_as_live(live: Trainer, cached: Trainer, monkeypatch, *, rel, grad_rtol):
    """Give `cached` (a trainer on a target cache) `live`'s draft and head weights, then check
    that steps 0 and 3 give the same losses, α, head loss (to `rel`) and gradients (to
    `grad_rtol`), while the target's forward raises during every cached step."""
    cached.draft.load_state_dict(live.draft.state_dict())
    cached.core.head_training.head.load_state_dict(live.core.head_training.head.state_dict())
    for step in (0, 3):
        for a, b in zip(live.micro_batches(step), cached.micro_batches(step), strict=True):
            want = loss_parts(live, a)
            with monkeypatch.context() as patch:  # the classes are shared with the live target
                patch.setattr(type(cached.target), "forward", lambda *a, **k: 1 / 0)
                got = loss_parts(cached, b)
            for w, g in zip(want[:3], got[:3], strict=True):
                assert g == pytest.approx(w, rel=rel, abs=1e-6), (step, want[:3], got[:3])
            assert want[3].keys() == got[3].keys() and want[3]
            for name in want[3]:
                torch.testing.assert_close(got[3][name], want[3][name], rtol=grad_rtol, atol=1e-6)


def overrides(tiny_pair, out: Path, **extra) -> list[str]:
    target, draft, data = tiny_pair
    base = {
        "target.model": str(target),
        "draft.model": str(draft),
        "data.train": str(data / "*.py"),
        "data.max_length": 32,
        "data.eval_fraction": 0.25,
        "train.max_steps": 8,
        "train.global_batch_size": 4,
        "train.micro_batch_size": 2,
        "train.warmup_steps": 2,
        "train.lr": 3e-3,
        "train.output_dir": str(out),
        "train.save_every": 0,
        "train.log_every": 1,
        "eval.every": 0,
        "eval.max_sequences": 16,
        "loss.name": "fkl",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def eagle_overrides(tiny_pair, target, out, **extra) -> list[str]:
    _, _, data = tiny_pair
    base = {
        "target.model": str(target),
        "draft.type": "eagle3",
        "draft.model": "null",
        "draft.aux_layers": "[0, 1]",  # the tiny target has 2 layers
        "draft.vocab_size": 200,
        "draft.ttt_steps": 3,
        "data.train": str(data / "*.py"),
        "data.max_length": 32,
        "data.eval_fraction": 0.25,
        "train.max_steps": 30,
        "train.global_batch_size": 4,
        "train.micro_batch_size": 2,
        "train.warmup_steps": 2,
        "train.lr": 3e-3,
        "train.output_dir": str(out),
        "train.save_every": 0,
        "train.log_every": 1,
        "eval.every": 0,
        "eval.max_sequences": 16,
        "loss.name": "lk_lambda",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def draft_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


class Killed(RuntimeError):
    pass


def run_cli(args: list[str], out: Path, processes: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    if processes == 1:
        cmd = [sys.executable, str(REPO / "train" / "distill.py")]
    else:
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(processes),
            "--num_machines",
            "1",
            "--main_process_port",
            str(free_port()),
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            str(REPO / "train" / "distill.py"),
        ]
    # a hang fails within the bound, with every process's stack, instead of blocking the suite
    proc = run_bounded(cmd + args, env=env, timeout=300)
    assert proc.returncode == 0, why_failed(proc)
    return metrics(out)


def train(tiny_pair, out: Path, **extra) -> Trainer:
    """One run of the tiny pair into `out` (extra: dotted recipe keys)."""
    trainer = Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, out, **extra)))
    trainer.run()
    return trainer


def kill_at(monkeypatch, step: int) -> None:
    """Make the next run die just before optimiser step `step` (0-based) trains."""
    original = Trainer.train_step

    def dies(self, s):
        if s == step:
            raise Killed
        return original(self, s)

    monkeypatch.setattr(Trainer, "train_step", dies)


def killed_and_resumed(tiny_pair, out: Path, monkeypatch, kill: int, **extra) -> Trainer:
    """A run killed before step `kill`, then resumed with train.resume=auto."""
    with monkeypatch.context() as m:
        kill_at(m, kill)
        with pytest.raises(Killed):
            train(tiny_pair, out, **extra)
    return train(tiny_pair, out, **extra, **{"train.resume": "auto"})


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "elapsed_s"} for m in records]


def seven_layer_config(draft: Path, out: Path) -> Path:
    """The tiny draft (1 layer) with a config that says 7 layers: 6 layers have no weights."""
    shutil.copytree(draft, out)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = 7
    (out / "config.json").write_text(json.dumps(config))
    return out


def one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def prepare_overrides(tiny_pair, tmp_path, **extra):
    """The tiny pair's recipe with a prepare section: 6 training prompts, 10 held out."""
    _, _, data = tiny_pair
    train_out, eval_out = tmp_path / "answers", tmp_path / "heldout"
    return overrides(
        tiny_pair,
        tmp_path / "run",
        **{
            "data.train": f"{train_out}/regen-*.jsonl",
            "data.eval": f"{eval_out}/regen-*.jsonl",
            "prepare.train.prompts": f"{data}/f0*.py",
            "prepare.train.out": str(train_out),
            "prepare.train.limit": 6,
            "prepare.eval.prompts": f"{data}/f1*.py",
            "prepare.eval.out": str(eval_out),
            "prepare.max_new_tokens": 5,
            **extra,
        },
    )


def read_answers(out):
    """The records of a regenerate directory's shards, in order."""
    return [
        json.loads(line)
        for shard in sorted(out.glob("regen-*.jsonl"))
        for line in shard.read_text().splitlines()
    ]
