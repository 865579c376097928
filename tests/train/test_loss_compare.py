"""benchmarks/loss_compare.py on the tiny pair: both levers, measured τ beside predicted."""

import json


def test_loss_compare_runs_both_levers_and_reports_measured_tau(tiny_pair, tmp_path):  # noqa: F811
    from benchmarks import loss_compare

    target, draft, data = tiny_pair
    report = loss_compare.main(
        [
            "--target", str(target), "--draft", str(draft), "--data", str(data / "*.py"),
            "--losses", "fkl,tv+fkl:loss.name=mix;loss.params={parts: {tv: 0.9, fkl: 0.1}}",
            "--on-policy-losses", "fkl", "--steps", "2", "--on-policy", "0.5", "--gamma", "2",
            "--spec-prompts", "2", "--out", str(tmp_path / "cmp"),
            "data.max_length=32", "data.eval_fraction=0.25", "train.global_batch_size=4",
            "train.micro_batch_size=2", "train.warmup_steps=1", "eval.max_sequences=8",
            "eval.speculative.max_new_tokens=8", "eval.speculative.prompt_tokens=8",
            "eval.tau_prompts=2", "eval.tau_prompt_tokens=8", "data.on_policy.prompt_tokens=8",
            "eval.every=1",
        ]
    )  # fmt: skip
    assert set(report["results"]) == {"fkl", "tv+fkl", "fkl+op"}
    for row in report["results"].values():
        assert all(0 <= a <= 1 for a in row["alpha"] + row["alpha_greedy"])
        assert all(1 <= t <= 3 for t in row["tau_pred"] + row["tau_measured"])
    assert report["results"]["fkl"]["tau_pred_ratio_vs_fkl"] == 1.0
    recipe = (tmp_path / "cmp" / "fkl+op-seed0" / "recipe.yaml").read_text()
    assert "fraction: 0.5" in recipe
    assert json.loads((tmp_path / "cmp" / "summary.json").read_text())["steps"] == 2
    mixed = (tmp_path / "cmp" / "tv+fkl-seed0" / "recipe.yaml").read_text()
    assert "name: mix" in mixed and "tv: 0.9" in mixed


def test_a_variant_is_a_label_and_its_overrides():
    from benchmarks.loss_compare import parse_variant, split_losses

    mix = "tv+fkl:loss.name=mix;loss.params={parts: {tv: 0.9, fkl: 0.1}}"
    text = f"fkl,{mix},lk:loss.name=lk_lambda"
    parts = split_losses(text)
    assert parts[0] == "fkl" and parts[2] == "lk:loss.name=lk_lambda"
    assert parse_variant(parts[0]) == ("fkl", "fkl", [])
    assert parse_variant(parts[1]) == (
        "tv+fkl",
        "mix",
        ["loss.params={parts: {tv: 0.9, fkl: 0.1}}"],
    )


def test_margin_study_splits_the_gap_of_each_run(tiny_pair, tmp_path):  # noqa: F811
    from benchmarks import loss_compare, margin_study

    target, draft, data = tiny_pair
    out = tmp_path / "cmp"
    loss_compare.main(
        [
            "--target", str(target), "--draft", str(draft), "--data", str(data / "*.py"),
            "--losses", "fkl,tv", "--steps", "2", "--spec-prompts", "0", "--out", str(out),
            "data.max_length=32", "data.eval_fraction=0.25", "train.global_batch_size=4",
            "train.micro_batch_size=2", "train.warmup_steps=1", "eval.max_sequences=8",
            "eval.tau_prompts=2", "eval.tau_prompt_tokens=8", "eval.every=1",
        ]
    )  # fmt: skip
    plot = tmp_path / "a.png"
    report = margin_study.main([str(out), "--max-sequences", "4", "--plot", str(plot)])
    assert set(report) == {"fkl", "tv"}
    for row in report.values():
        assert sorted(row["curve"]) == [0, 1, 2]
        (alpha,), (gap,), (share,) = row["alpha"], row["gap"], row["starved_share"]
        assert 0 < alpha < 1 and abs(alpha + gap - 1) < 1e-6 and 0 <= share <= 1
    assert plot.stat().st_size > 0
    assert json.loads((out / "margin_study.json").read_text())["tv"]["positions"][0] > 0
