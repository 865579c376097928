"""benchmarks/real_drift.py on the real target at a small size (heavy: tests/heavy.py): an
SFT of SmolLM2-135M-Instruct in the bullets style, the drift report and gate of a draft of its
first 2 layers at T = 0 and 1, the unchanged target against itself (a drop of exactly 0,
the gate passes), repair data regenerated with the adapter, a refit and a fresh draft, each
measured again; and the styles' rewriting on its own (fast)."""

import json

import torch

from benchmarks.real_drift import bullets, code_only, kind_of, main, sft_records

ANSWER = (
    "This adds two numbers. It returns the sum.\n\n"
    "```python\ndef add(a, b):\n    return a + b\n```\nDone!"
)


def test_the_styles_rewrite_answers(tmp_path):
    assert code_only(ANSWER) == "```python\ndef add(a, b):\n    return a + b\n```"
    assert code_only("no code here.") is None
    assert bullets(ANSWER) == (
        "Key points:\n\n- This adds two numbers.\n- It returns the sum.\n"
        "```python\ndef add(a, b):\n    return a + b\n```\n- Done!"
    )
    assert kind_of("Write a Python function `f(x)` that") == "write"
    assert kind_of("How do I use `re.sub` in Python?") == "use"
    path = tmp_path / "regen-000001.jsonl"
    rows = [("Write a Python function `add(a, b)`", ANSWER), ("Explain what this does", ANSWER)]
    path.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": q},
                                 {"role": "assistant", "content": a}]}) + "\n"
        for q, a in rows))  # fmt: skip
    assert len(sft_records(str(tmp_path / "regen-*.jsonl"), "code-only")) == 1
    assert len(sft_records(str(tmp_path / "regen-*.jsonl"), "bullets")) == 2


def test_real_fine_tune_drift_gate_and_repair_at_a_small_size(tmp_path):
    from specdistill.data.instructions import stdlib_instructions
    from specdistill.drafts.draft_init import init_from_target
    from specdistill.models.hub import load_target, load_tokenizer

    torch.set_num_threads(1)
    name = "registry:smollm2-135m-instruct"
    draft = init_from_target(load_target(name), load_tokenizer(name), 2, tmp_path / "draft")
    answers = tmp_path / "answers" / "regen-000001.jsonl"
    answers.parent.mkdir()
    answers.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": q},
                                 {"role": "assistant", "content": ANSWER}]}) + "\n"
        for q in stdlib_instructions("train")[:6]))  # fmt: skip
    out = tmp_path / "ft"
    result = main(
        ["--fine-tune", "bullets", "--out", str(out), "--answers", str(answers),
         "--drafts", f"small={draft}", "--sft-steps", "3", "--sft-batch", "2",
         "--eval-prompts", "4", "--self-prompts", "3", "--max-new-tokens", "8",
         "--regen-prompts", "4", "--refit-steps", "2", "--full-steps", "2",
         "--start", "target-layers:1", "--start-vocab", "0"]
    )  # fmt: skip
    small = result["drift"]["small"]
    assert set(small) == {"T0", "T1", "gate"}
    for t in ("T0", "T1"):
        assert 0 <= small[t]["alpha_after"] <= 1 and small[t]["tau5_before"] >= 1
        assert result["self"][t]["drop"] == 0.0  # the unchanged target: exactly no drift
    assert result["self"]["gate"]["failed"] is False
    repair = result["repair"]
    assert [h["step"] for h in repair["curve"]][:2] == [0, 1]
    assert 0 <= repair["refit_T1"] <= 1 and 0 <= repair["fresh_T0"] <= 1
    assert (out / "summary.md").read_text().count("| small |") == 4
    assert (out / "adapter" / "adapter_config.json").is_file()


def test_the_repair_table_without_a_fresh_draft():
    from benchmarks.real_drift_tables import repair_lines

    r = {"refit_steps": 30, "fresh_steps": None, "fresh_curve": [],
         "curve": [{"step": 0, "alpha": 0.30, "recovered": 0.0},
                   {"step": 30, "alpha": 0.36, "recovered": 1.2}],
         "refit_T0": 0.41, "refit_recovered_T0": 0.5, "refit_T1": 0.37,
         "refit_recovered_T1": 1.2, "fresh_steps_to_refit_alpha": None}  # fmt: skip
    text = "\n".join(repair_lines(r))
    assert "| 30 | 0.360 | 120% |" in text
    assert "- T0: refit (30 steps) α after 0.410, recovered 50% of the drop\n" in text + "\n"
    assert "fresh" not in text and "reaches" not in text
    r.update(fresh_steps=150, fresh_T1=0.35, fresh_recovered_T1=0.9, fresh_steps_to_refit_alpha=90,
             fresh_curve=[{"step": 150, "alpha": 0.35}])  # fmt: skip
    text = "\n".join(repair_lines(r))
    assert "fresh (150 steps) α after 0.350, 90%" in text and "at step 90" in text
    assert "| 150 | 0.350 |" in text
