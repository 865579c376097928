"""The one screen `speculate` prints (eval/report_console.py) and the plots' styles
(eval/report_plots.py), on sweep results built by hand."""

import pytest

from specdistill.eval.report_console import console_summary, lossless_line
from specdistill.eval.report_plots import Styles, gamma_order

GAMMAS = [1, 2, 3, 4, 6, 8, "auto", "adaptive"]


def greedy_check(identical, near_ties=0, prompts=10):
    """A `GreedyCheck` as the sweep's result holds it (divergences left out)."""
    return {"prompts": prompts, "identical": identical, "near_ties": near_ties,
            "real_errors": prompts - identical - near_ties}  # fmt: skip


def entry(t, gamma, speedup, check=None):
    label = gamma if isinstance(gamma, str) else f"gamma={gamma}"
    return {
        "name": f"T={t:g} {label}",
        "temperature": t,
        "gamma": gamma,
        "speedup": speedup,
        "tau": 1 + speedup,
        "tokens_per_s": 100 * speedup,
        "greedy_identical": None if check is None else check["identical"],
        "greedy_check": check,
    }


def result(identical=10, busy=None, near_ties=0):
    """Two temperatures of every γ; at T=0 each configuration has `identical` of 10 outputs
    equal to the target alone's and `near_ties` near-ties (with near-ties, γ=1 has none)."""
    configs = []
    for t in (0.0, 1.0):
        for i, g in enumerate(GAMMAS):
            check = None
            if t == 0:
                tied = near_ties and i == 0
                check = greedy_check(10) if tied else greedy_check(identical, near_ties)
            configs.append(entry(t, g, 1 + 0.1 * i - (0.05 * i * i if t else 0), check))
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
    assert line.startswith(
        "LOSSLESS CHECK FAILED at T=0, real errors in: T=0 gamma=1 (9/10 identical, "
        "1 real error), T=0 gamma=2 (9/10 identical, 1 real error),"
    )
    assert "at T=1 outputs follow the target's distribution" in line
    # Near-ties beside a real error: the check still fails, naming each kind's count.
    line = lossless_line(result(identical=7, near_ties=2)["configs"], 10)
    assert line.startswith(
        "LOSSLESS CHECK FAILED at T=0, real errors in: "
        "T=0 gamma=2 (7/10 identical, 1 real error, 2 near-ties)"
    )


def test_outputs_that_differ_only_at_near_ties_pass_the_check():
    """Every configuration but γ=1 (identical) diverges on 2 prompts, each at a near-tie of
    the target's argmax."""
    line = lossless_line(result(identical=8, near_ties=2)["configs"], 10)
    assert "FAILED" not in line and line.startswith("Lossless at T=0 up to rounding:")
    assert "T=0 gamma=1" not in line
    assert "T=0 gamma=2 (8/10 identical, 2 near-ties), T=0 gamma=3" in line
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
