"""A diverged run is never scored as perfect: non-finite recipe numbers are refused, a step
whose loss (or updated weights) is not finite stops the run with one line and exit 2, before
final/, best/ or eval.json are written, and the checkpoints already written are kept."""

import json
import math

import pytest
import torch

from specdistill.errors import run_guarded
from specdistill.train.config import RecipeError, load_recipe
from specdistill.train.distill import main as distill_main
from specdistill.train.step import StepMetrics, TrainingDiverged, check_finite
from tests.train.helpers import overrides


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=inf", "train.lr: must be a finite number, got inf"),
        ("train.lr=.inf", "train.lr: must be a finite number, got inf"),
        ("train.lr=nan", "train.lr must be > 0, got nan"),
        ("train.max_grad_norm=inf", "train.max_grad_norm: must be a finite number, got inf"),
        ("acceptance_head.lr=inf", "acceptance_head.lr: must be a finite number, got inf"),
        ("online.refresh_seconds=.inf", "online.refresh_seconds: must be a finite number"),
        ("online.min_gain=nan", "online.min_gain: must be a finite number, got nan"),
        ("loss.temperature=inf", "loss.temperature must be a finite temperature > 0"),
        ("loss.temperature={0: 0.5, .inf: 0.5}", "loss.temperature must be a finite"),
        ("loss.top_p=nan", "loss.top_p: must be a finite number, got nan"),
    ],
)
def test_number_keys_refuse_infinity_and_nan_naming_the_key(override, message):
    with pytest.raises(RecipeError) as error:
        load_recipe(None, [override])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_diverged_run_stops_with_one_line_and_writes_no_result(tiny_pair, tmp_path, capsys):
    out = tmp_path / "run"
    argv = overrides(tiny_pair, out, **{"train.lr": 1e30, "train.save_every": 1})
    assert run_guarded(distill_main, argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    assert err[0].startswith("error: training diverged at step 2: loss nan")
    assert "lower train.lr" in err[0]
    for result in ("final", "best", "eval.json"):
        assert not (out / result).exists()
    # step 1's checkpoint, written before the divergence, is kept as it was
    (checkpoint,) = (out / "checkpoints").iterdir()
    assert checkpoint.name == "step-0000001"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["step"] == 1
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if "loss" in m] == [1]  # no record of the diverged step


def metrics(**changes) -> StepMetrics:
    base = StepMetrics(step=3, loss=1.5, alpha=0.5, lr=1e-3, grad_norm=0.7, tokens=10)
    return StepMetrics(**{**base.__dict__, **changes})


@pytest.mark.parametrize(
    "changes, nonfinite, message",
    [
        ({"loss": math.inf}, 0, "training diverged at step 3: loss inf, alpha 0.5"),
        ({"head_loss": math.nan}, 0, "training diverged at step 3: loss 1.5, head_loss nan"),
        ({}, 2, "; 2 trained parameter tensor(s) NaN or infinite after the update"),
    ],
)
def test_a_step_with_a_non_finite_loss_or_weights_is_refused(changes, nonfinite, message):
    with pytest.raises(TrainingDiverged) as error:
        check_finite(metrics(**changes), nonfinite)
    assert message in str(error.value)
    check_finite(metrics(head_loss=0.2), 0)  # a finite step passes


def test_a_nan_draft_evaluates_as_accepting_nothing(tiny_pair, tmp_path):
    """Held-out α of a draft whose weights are NaN is 0 (greedy too) and τ_pred is 1, not the
    α ≈ 1 / τ_pred = γ + 1 a NaN comparison would give."""
    from specdistill.train.trainer import Trainer

    recipe = load_recipe(None, overrides(tiny_pair, tmp_path / "run", **{"eval.tau_prompts": 2}))
    trainer = Trainer.from_recipe(recipe)
    with torch.no_grad():
        for p in trainer.core.draft_module().parameters():
            p.fill_(math.nan)
    result = trainer.evaluate()
    assert result["alpha"] == 0.0 and result["alpha_greedy"] == 0.0
    assert set(result["tau_pred"].values()) == {1.0}
    assert set(result["tau_pred_iid"].values()) == {1.0}
