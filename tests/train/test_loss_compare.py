"""benchmarks/loss_compare.py on the tiny pair: both levers, measured τ beside predicted."""

import json

from tests.train.conftest import tiny_pair  # noqa: F401 - the session fixture


def test_loss_compare_runs_both_levers_and_reports_measured_tau(tiny_pair, tmp_path):  # noqa: F811
    from benchmarks import loss_compare

    target, draft, data = tiny_pair
    report = loss_compare.main(
        [
            "--target", str(target), "--draft", str(draft), "--data", str(data / "*.py"),
            "--losses", "fkl", "--steps", "2", "--on-policy", "0.5", "--gamma", "2",
            "--spec-prompts", "2", "--out", str(tmp_path / "cmp"),
            "data.max_length=32", "data.eval_fraction=0.25", "train.global_batch_size=4",
            "train.micro_batch_size=2", "train.warmup_steps=1", "eval.max_sequences=8",
            "eval.speculative.max_new_tokens=8", "eval.speculative.prompt_tokens=8",
            "eval.tau_prompts=2", "eval.tau_prompt_tokens=8", "data.on_policy.prompt_tokens=8",
        ]
    )  # fmt: skip
    assert set(report["results"]) == {"fkl", "fkl+op"}
    for row in report["results"].values():
        assert all(0 <= a <= 1 for a in row["alpha"] + row["alpha_greedy"])
        assert all(1 <= t <= 3 for t in row["tau_pred"] + row["tau_measured"])
    assert report["results"]["fkl"]["tau_pred_ratio_vs_fkl"] == 1.0
    recipe = (tmp_path / "cmp" / "fkl+op-seed0" / "recipe.yaml").read_text()
    assert "fraction: 0.5" in recipe
    assert json.loads((tmp_path / "cmp" / "summary.json").read_text())["steps"] == 2
