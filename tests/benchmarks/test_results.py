"""benchmarks/results.py: each benchmark replaces its own fenced section of RESULTS.md."""

import argparse

from benchmarks import results


def _section(body: str, key: str = "demo") -> results.Section:
    return results.Section(
        key=key,
        title="A demo",
        body=body,
        command="python -m benchmarks.demo",
        machine="m",
        date="d",
    )


def test_a_section_is_appended_then_replaced_and_other_text_is_kept(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Results\n\nWritten by hand.\n")
    results.write(_section("| a |\n|---|\n| 1 |"), path)
    results.write(_section("first", key="other"), path)
    results.write(_section("| a |\n|---|\n| 2 |"), path)
    text = path.read_text()
    assert text.startswith("# Results\n\nWritten by hand.\n")
    assert text.count("<!-- results:demo -->") == 1 and text.count("<!-- /results:demo -->") == 1
    assert "| 2 |" in text and "| 1 |" not in text
    assert "first" in text  # the other benchmark's section is untouched
    assert text.index("results:demo") < text.index("results:other")  # replaced in place
    assert "```bash\npython -m benchmarks.demo\n```" in text and "## A demo (d)" in text


def test_the_command_line_is_the_module_form_with_quoted_arguments():
    line = results.command_line(["benchmarks/serve_load.py", "--gammas", "0,2", "--out", "a b"])
    assert line == "python -m benchmarks.serve_load --gammas 0,2 --out 'a b'"


def test_results_flag_defaults_to_the_repository_file():
    parser = argparse.ArgumentParser()
    results.add_argument(parser)
    assert parser.parse_args([]).results is None
    assert parser.parse_args(["--results"]).results == str(results.RESULTS)
    assert parser.parse_args(["--results", "x.md"]).results == "x.md"
    assert results.RESULTS.name == "RESULTS.md" and results.RESULTS.parent.name == "benchmarks"


def test_machine_line_names_the_cpu_and_torch():
    line = results.machine_line()
    assert "cores visible" in line and "torch" in line
