"""benchmarks/threads_under_load.py: four timed runs of the command (quiet and busy, forced
and chosen threads), each with its own --out, and a busy ÷ quiet ratio per setting."""

import sys

from benchmarks import threads_under_load as bench


def test_four_runs_each_with_its_own_output_and_a_ratio_per_setting(tmp_path, capsys):
    script = (
        "import sys, pathlib; a = sys.argv; "
        "pathlib.Path(a[a.index('--out') + 1]).write_text(' '.join(a[1:]))"
    )
    out = tmp_path / "o"
    assert bench.main(["--", sys.executable, "-c", script, "--out", str(out)]) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["o-after-busy", "o-after-quiet", "o-before-busy", "o-before-quiet"]
    assert "--threads" in (tmp_path / "o-before-busy").read_text()
    assert "--threads" not in (tmp_path / "o-after-quiet").read_text()
    printed = capsys.readouterr().out
    assert "| before: `--threads" in printed and "| after: chosen by the verb |" in printed


def test_a_failing_command_stops_with_its_error():
    import pytest

    with pytest.raises(SystemExit, match="exited 3"):
        bench.main(["--", sys.executable, "-c", "import sys; sys.exit(3)"])
