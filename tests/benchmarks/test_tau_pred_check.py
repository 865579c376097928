"""benchmarks/tau_pred_check.py end to end on the tiny pair: at T = 0 the round-aware
figures (teacher-forced rounds and the draft's own chains) replay the engine's rounds, so
they equal measured τ at every γ; the table marks what lies outside ±3%."""

import json

from benchmarks.tau_pred_check import main, table


def test_round_aware_figures_equal_measured_tau_at_temperature_zero(tiny_pair, tmp_path):
    target, draft, data = tiny_pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n"}) + "\n" for i in range(3)))
    out = tmp_path / "rows.json"
    rows = main(
        ["--target", str(target), "--draft", str(draft), "--in-domain", str(data),
         "--prompts", str(prompts), "--num-prompts", "3", "--max-new-tokens", "12",
         "--gammas", "1,3", "--temperatures", "0", "--out", str(out)]
    )  # fmt: skip
    assert [(r["domain"], r["gamma"]) for r in rows] == [
        (str(data), 1), (str(data), 3), ("prompts.jsonl", 1), ("prompts.jsonl", 3)
    ]  # fmt: skip
    for r in rows:
        assert r["measured_rounds"] > 0
        assert abs(r["pred_rounds"] - r["measured_tau"]) < 1e-9, r
        assert abs(r["pred_chain_rounds"] - r["measured_tau"]) < 1e-9, r
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    text = table(rows)
    assert "chain_rounds 2/2" in text


def test_table_marks_an_error_beyond_three_percent():
    row = {
        "domain": "d", "prompts": 1, "temperature": 1.0, "gamma": 2, "measured_rounds": 9,
        "measured_tau": 2.0, "measured_se": 0.1, "chain_rounds_se": 0.1, "z_chain_rounds": 0.5,
    }  # fmt: skip
    preds = {"iid": 2.02, "rounds": 2.1, "chain_starts": 1.9, "chain_rounds": 2.0}
    for name, pred in preds.items():
        row[f"pred_{name}"], row[f"err_{name}"] = pred, (pred - 2.0) / 2.0
    text = table([row])
    assert "+1.0% |" in text and "+5.0% ✗" in text and "-5.0% ✗" in text
    assert "iid 1/1, rounds 0/1, chain_starts 0/1, chain_rounds 1/1" in text
