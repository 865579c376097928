"""benchmarks/loss_tau.py: one speculate run per (draft, prompt set), kept and not run again;
τ averaged over seeds per loss, each seed's interval shown, the ratio against fkl."""

import json
from pathlib import Path

import pytest

from benchmarks import loss_tau

TAU = {("fkl", 0): 1.5, ("fkl", 1): 1.7, ("tv", 0): 1.2}


@pytest.fixture
def study(tmp_path, monkeypatch):
    drafts = []
    for loss, seed in TAU:
        final = tmp_path / f"{loss}-seed{seed}" / "final"
        final.mkdir(parents=True)
        drafts.append(final)
    calls = []

    def fake_speculate(argv):
        out = Path(argv[argv.index("--out") + 1])
        loss, seed = loss_tau.run_label(Path(argv[argv.index("--draft") + 1]))
        calls.append((loss, seed, argv[argv.index("--prompts") + 1]))
        tau = TAU[loss, seed]
        configs = [
            {"temperature": t, "gamma": g, "tau": tau + t, "tau_interval": [tau - 0.1, tau + 0.1]}
            for t in (0.0, 1.0)
            for g in (3, 4)
        ]
        out.mkdir()
        (out / "report.json").write_text(json.dumps({"configs": configs}))

    monkeypatch.setattr(loss_tau.speculative, "main", fake_speculate)
    return drafts, calls


def test_table_means_seeds_and_compares_with_fkl(study, capsys):
    drafts, calls = study
    args = [*map(str, drafts), "--prompt-set", "a=a.jsonl", "--prompt-set", "b=b.jsonl"]
    assert loss_tau.main(args) == 0
    assert len(calls) == 6  # 3 drafts × 2 prompt sets
    text = capsys.readouterr().out
    fkl = next(line for line in text.splitlines() if line.startswith("| fkl "))
    tv = next(line for line in text.splitlines() if line.startswith("| tv "))
    assert "**1.600** (1.500 [1.40, 1.60]; 1.700 [1.60, 1.80])" in fkl  # a, T = 0
    assert "**2.600**" in fkl  # T = 1: τ + 1 in the fake
    assert f"| {1.2 / 1.6:.3f} |" in tv and tv.endswith(f"| {2.2 / 2.6:.3f} |")
    assert loss_tau.main(args) == 0
    assert len(calls) == 6  # the kept reports are read, nothing runs again


def test_a_draft_outside_a_study_run_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="not inside a loss_compare run"):
        loss_tau.run_label(tmp_path / "final")
