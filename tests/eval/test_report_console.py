"""The one screen `speculate` prints (eval/report_console.py) and the plots' styles
(eval/report_plots.py), on sweep results built by hand."""

import pytest

from specdistill.eval.report_console import console_summary, lossless_line
from specdistill.eval.report_plots import Styles, gamma_order

GAMMAS = [1, 2, 3, 4, 6, 8, "auto", "adaptive"]


def entry(t, gamma, speedup, identical=None):
    label = gamma if isinstance(gamma, str) else f"gamma={gamma}"
    return {
        "name": f"T={t:g} {label}",
        "temperature": t,
        "gamma": gamma,
        "speedup": speedup,
        "tau": 1 + speedup,
        "tokens_per_s": 100 * speedup,
        "greedy_identical": identical,
    }


def result(identical=10, busy=None):
    configs = [
        entry(t, g, 1 + 0.1 * i - (0.05 * i * i if t else 0), identical if t == 0 else None)
        for t in (0.0, 1.0)
        for i, g in enumerate(GAMMAS)
    ]
    best = {}
    for t in ("0", "1"):
        fixed = [e for e in configs if f"{e['temperature']:g}" == t and isinstance(e["gamma"], int)]
        top = max(fixed, key=lambda e: e["tokens_per_s"])
        best[t] = {"measured": top["gamma"], "speedup": top["speedup"]}
    return {
        "settings": {"max_new_tokens": 64, "batch_size": 1},
        "baselines": {"0": {"name": "T=0 target-only", "tokens_per_s": 100.0},
                      "1": {"name": "T=1 target-only", "tokens_per_s": 100.0}},
        "configs": configs,
        "best_gamma": best,
        "meta": {"target": "embedded:code-deep", "draft": "runs/code/final", "n_prompts": 10,
                 "device": "cpu", "dtype": "float32", "threads": 1, "cores": 2,
                 "busy_load_average": busy},
    }  # fmt: skip


def test_one_screen_with_the_best_gamma_per_temperature():
    screen = console_summary(result(), "runs/spec")
    lines = screen.splitlines()
    text = " ".join(screen.split())  # notes wrap at 100 columns
    assert len(lines) <= 20 and max(len(line) for line in lines) <= 100
    best = "best γ = 8: 150.0 tok/s, 1.50x the target alone, τ 2.50"
    assert f"T=0: target alone 100.0 tok/s; {best}" in lines
    best = "best γ = 2: 105.0 tok/s, 1.05x the target alone, τ 2.05"
    assert f"T=1: target alone 100.0 tok/s; {best}" in lines
    header = next(line for line in lines if "γ=1" in line)
    assert header.split() == ["γ=1", "γ=2", "γ=3", "γ=4", "γ=6", "γ=8", "auto", "adaptive"]
    speedups = [line.split()[1:] for line in lines if line.strip().startswith("speedup")]
    assert speedups[0][:3] == ["1.00", "1.10", "1.20"]
    assert "Lossless: at T=0 every output equals the target alone's, token for token" in text
    assert "(10 prompts x 8 configurations)" in text
    assert "runs/spec/report.md" in text
    assert "busy" not in text


def test_a_busy_run_says_so():
    text = " ".join(console_summary(result(busy=3.4), None).split())
    assert "The machine was busy during the run (load average up to 3.4 on 2 cores)" in text


def test_a_greedy_output_that_differs_fails_the_check_loudly():
    line = lossless_line(result(identical=9)["configs"], 10)
    assert line.startswith("LOSSLESS CHECK FAILED at T=0: T=0 gamma=1 (9/10 identical)")
    assert "at T=1 outputs follow the target's distribution" in line
    sampled_only = [e for e in result()["configs"] if e["temperature"] > 0]
    assert lossless_line(sampled_only, 10).startswith("at T=1 outputs follow")


def test_every_series_has_a_look_of_its_own():
    """Colour by γ, line style by temperature: 16 series, 16 looks; "T=0 γ=1" and
    "T=1 γ=1" share a colour and differ in line style."""
    pytest.importorskip("matplotlib")
    r = result()
    styles = Styles(r)
    looks = {
        (str(styles.line(e["temperature"], e["gamma"])["color"]),
         styles.line(e["temperature"], e["gamma"])["ls"])
        for e in r["configs"]
    }  # fmt: skip
    assert len(looks) == len(r["configs"]) == 16
    colours = {str(styles.line(0.0, g)["color"]) for g in GAMMAS}
    assert len(colours) == len(GAMMAS)
    assert styles.line(0.0, 1)["color"] == styles.line(1.0, 1)["color"]
    assert styles.line(0.0, 1)["ls"] != styles.line(1.0, 1)["ls"]
    assert styles.line("1", None)["color"] == "black"  # the target alone
    assert styles.bar(0.0, 2)["hatch"] != styles.bar(1.0, 2)["hatch"]
    assert gamma_order(r["configs"]) == GAMMAS
    series = styles.series_of(r)
    assert series["T=0 target-only"] == ("0", None) and series["T=1 auto"] == ("1", "auto")
