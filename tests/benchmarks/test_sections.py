"""Each benchmark's `--results` section, built from synthetic rows (no model runs): the table it
prints, under its own fence, with the command and the machine."""

import argparse

import pytest

from benchmarks import draft_types, loss_compare, parallel_cost, results


def _written(section: results.Section, tmp_path) -> str:
    path = tmp_path / "RESULTS.md"
    path.write_text("# Results\n\nWritten by hand.\n")
    results.write(section, path)
    return path.read_text()


def _table(text: str) -> list[list[str]]:
    """The Markdown table rows of `text`, cells stripped, separator row dropped."""
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row] for row in rows if not set("".join(row)) <= {"-"}]


def test_parallel_cost_section_holds_the_printed_table(tmp_path):
    times = {
        ("standalone", 2): ([0.004, 0.006, 0.005], [0.030, 0.034, 0.032]),
        ("parallel", 2): ([0.002, 0.003, 0.0025], [0.031, 0.033, 0.035]),
        ("standalone", 4): ([0.010, 0.012, 0.011], [0.036, 0.040, 0.038]),
        ("parallel", 4): ([0.003, 0.0035, 0.004], [0.037, 0.039, 0.041]),
    }
    rows = parallel_cost.table(times, [2, 4])
    # γ = 2: standalone 5 ms, parallel 2.5 ms, verify median of all six 32.5 ms
    assert rows[0] == ["2", "5.00", "2.50", "0.50", "32.50", "0.13", "0.07"]
    assert rows[1][:4] == ["4", "11.00", "3.50", "0.32"]
    text = _written(parallel_cost.results_section(rows, repeats=3, threads=1), tmp_path)
    assert text.count("<!-- results:parallel_cost -->") == 1
    assert "medians of 3 interleaved rounds" in text and "1 thread(s)" in text
    assert _table(text) == [parallel_cost.HEADER, *rows]
    assert "Written by hand." in text and "```bash\npython -m benchmarks." in text


def _config(name: str, tau: float, depth: list[float] | None = None) -> dict:
    return {
        "name": name,
        "alpha_offline": 0.61,
        "alpha_offline_depth": depth,
        "tau": tau,
        "tau_pred": tau + 0.1,
        "cost_ratio_c": 0.1234,
        "draft_time_share": 0.2,
        "speedup": 1.5,
        "engine_efficiency": 0.9,
        "tokens_per_s": 60.0,
        "target_tokens_per_s": 40.0 if name.startswith("T=0") else 20.0,
    }


def test_draft_types_section_holds_the_printed_table(tmp_path):
    rows = [
        ("standalone", "lk_lambda", 720_000, 0.6371, _config("T=0 gamma=3", 2.5)),
        ("eagle3", "fkl", 740_000, 0.6, _config("T=1 gamma=3", 2.25, [0.7, 0.55, 0.5])),
    ]
    cells = draft_types.table(rows)
    assert cells[0] == [
        "standalone", "lk_lambda", "0.72M", "0.637", "T=0 gamma=3", "0.61", "2.50", "2.60",
        "0.123", "0.20", "1.50", "0.90", "60.0", "40.0", "1.50",
    ]  # fmt: skip
    assert cells[1][5] == "0.70 0.55 0.50"  # a head's α per depth, not its mean
    assert cells[1][-1] == "3.00"  # 60 tok/s over the T=1 rows' fastest target, 20 tok/s
    slower = (
        "parallel",
        "fkl",
        700_000,
        0.6,
        {**_config("T=0 gamma=2", 2.0), "target_tokens_per_s": 10.0},
    )
    assert draft_types.table(rows + [slower])[2][-1] == "1.50"  # the T=0 baseline stays 40
    section = draft_types.results_section("10 steps each", "embedded:code", cells)
    text = _written(section, tmp_path)
    assert text.count("<!-- /results:draft_types -->") == 1
    assert "Target `embedded:code`; 10 steps each." in text
    assert _table(text) == [draft_types.HEADER, *cells]


def test_loss_compare_section_holds_the_summary_with_ratios_and_spread(tmp_path):
    summary = {
        "fkl": {
            "alpha": [0.70, 0.72],
            "alpha_greedy": [0.5, 0.5],
            "tau_pred": [2.8, 3.0],
            "tau_measured": [2.9, 2.9],
            "tau_pred_ratio_vs_fkl": 1.0,
            "tau_measured_ratio_vs_fkl": 1.0,
        },
        "tau": {
            "alpha": [0.63, 0.63],
            "alpha_greedy": [0.46, 0.48],
            "tau_pred": [2.46, 2.46],
            "tau_measured": [None, None],  # measured τ off: a dash, no ratio
            "tau_pred_ratio_vs_fkl": 0.8483,
            "tau_measured_ratio_vs_fkl": None,
        },
    }
    first = {
        "temperature": 1.0,
        "steps": 60,
        "alpha_before": 0.638,
        "alpha_greedy_before": 0.47,
        "tau_pred_before": {5: 2.495},
    }
    section = loss_compare.results_section(summary, first, seeds=[0, 1], gamma=5)
    text = _written(section, tmp_path)
    assert "## Losses at equal steps (" in text and text.count("results:loss_compare -->") == 2
    assert "2 seed(s) (0, 1), 60 steps each" in text and "τ_pred(5) 2.495" in text
    header, fkl, tau = _table(text)
    assert header[1:5] == ["α T=1.0", "α T=0", "τ_pred(5)", "τ measured(5)"]
    assert fkl == ["fkl", "0.7100 ± 0.0141", "0.5000 ± 0.0000", "2.9000 ± 0.1414"] + [
        "2.9000 ± 0.0000",
        "1.000",
        "1.000",
    ]
    assert tau[4:] == ["-", "0.848", "-"]
    assert "--report-only" not in text
    again = loss_compare.results_section(summary, first, seeds=[0, 1], gamma=5, report_only=True)
    assert "without `--report-only` the command trains them" in again.body


def test_results_flag_refuses_a_recipe_override_as_its_path():
    parser = argparse.ArgumentParser()
    results.add_argument(parser)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(["a=1", "--results"])
    assert args.results == str(results.RESULTS) and args.overrides == ["a=1"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--results", "train.max_steps=3"])


def test_serve_threads_section_holds_the_printed_table(tmp_path):
    from benchmarks import serve_threads

    rows = {
        "default": {"startup_s": 46.71, "first_s": 0.694, "latency_s": [0.5, 1.81, 0.73]},
        "1": {"startup_s": 33.7, "first_s": 1.95, "latency_s": [1.32, 1.96, 2.66, 2.0]},
    }
    for row in rows.values():
        row["tokens"] = 32
    cells = serve_threads.table(rows)
    assert cells[0] == ["default", "46.7", "0.69", "0.50 / 0.73 / 1.81", "32"]
    assert cells[1][3] == "1.32 / 1.98 / 2.66"  # the median of an even count
    text = _written(serve_threads.results_section("10 requests", cells), tmp_path)
    assert text.count("<!-- results:serve_threads -->") == 1 and "10 requests." in text
    assert _table(text) == [serve_threads.HEADER, *cells]


def test_serve_load_section_holds_goodput_and_auto_against_the_best_fixed_gamma(tmp_path):
    from benchmarks import serve_load

    gammas, cells = ["0", "2", "auto"], {}
    for g, tokens in (("0", 100), ("2", 160), ("auto", 120)):
        for m in (1, 4):
            cells[g, m] = serve_load.Cell(g, m, requests=2, tokens=tokens * m, wall_s=1.0)
    cells["auto", 1].drafted = [1, 0, 3]  # 4 rounds: one target-only, three of 2 drafts
    header, rows = serve_load.table(cells, gammas, [1, 4])
    assert header == ["clients", "no draft", "γ=2", "γ=auto", "auto mean γ"] + [
        "auto target-only",
        "auto/best fixed",
        "auto/no draft",
    ]
    assert rows[0] == ["1", "100.0", "160.0", "120.0", "1.50", "25%", "0.75 (γ=2)", "1.20"]
    assert rows[1][:4] == ["4", "400.0", "640.0", "480.0"] and rows[1][4] == "nan"
    text = _written(serve_load.results_section("goodput.", header, rows), tmp_path)
    assert text.count("<!-- /results:serve_load -->") == 1
    assert _table(text) == [header, *rows]
