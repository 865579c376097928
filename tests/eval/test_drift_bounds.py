"""`specdistill drift` refuses numbers that would disable the gate or exhaust the machine: a
mixture weight that overflows (1e400, two of 1e308), a gate threshold outside [0, 1] (2 for
"2%"), γ, bootstrap, depth and cell sizes past their ranges are usage errors (exit 2) before
any model loads; --depth past the depths an EAGLE-3 head was trained at is one line; a
temperature below 1e-5 is measured greedily, as the server decodes it."""

import json

import pytest

from specdistill.eval import drift_cli
from specdistill.eval.drift_gate import parse_mix
from tests.eval.helpers import drift_argv


def _prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def add(a, b):\n"] * 4))
    return path


def _usage_error(tiny_pair, tmp_path, capsys, option: str, value: str) -> str:
    """Drift's stderr for `option value`, after checking it exited 2 with no traceback and
    wrote nothing."""
    target, draft, _ = tiny_pair
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as info:
        drift_cli.main([*drift_argv(draft, target, _prompts(tmp_path), out), option, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert not out.exists()
    return err


@pytest.mark.parametrize("mix", ["1:1e400", "0:1,1:1e400", "1:1e308,0:1e308", "inf:1", "0:nan"])
def test_an_overflowing_mixture_is_refused(mix):
    with pytest.raises(ValueError, match="finite"):
        parse_mix(mix)


@pytest.mark.parametrize(
    "option, value",
    [
        ("--temperature-mix", "1:1e400"),
        ("--temperature-mix", "1:1e308,0:1e308"),
        ("--fail-if-drop-above", "5"),
        ("--fail-if-drop-above", "-0.1"),
        ("--fail-if-tau-drop-above", "2"),
        ("--threshold", "3"),
        ("--tau-gamma", "1000000000"),
        ("--max-gamma", "1000000000"),
        ("--bootstrap", "1000000000"),
        ("--depth", "0"),
        ("--depth", "-1"),
        ("--depth", "1000000"),
        ("--min-samples", "0"),
        ("--min-samples", "-1"),
        ("--batch-size", str(10**30)),
    ],
)
def test_numbers_out_of_range_are_usage_errors(tiny_pair, tmp_path, capsys, option, value):
    err = _usage_error(tiny_pair, tmp_path, capsys, option, value)
    assert f"argument {option}: needs" in err


def test_depth_on_a_standalone_draft_is_one_line(tiny_pair, tmp_path):
    from specdistill.errors import run_guarded

    target, draft, _ = tiny_pair
    out = tmp_path / "out"
    argv = [*drift_argv(draft, target, _prompts(tmp_path), out), "--depth", "3"]
    assert run_guarded(drift_cli.main, argv) == 2
    assert not out.exists()


def test_a_tiny_temperature_is_measured_greedily(tiny_pair, tmp_path):
    """draft = target: α is 1 at every temperature; at 1e-300 too (not 0, which no gate fires
    on), reported as greedy."""
    target, _, _ = tiny_pair
    argv = [
        *drift_argv(target, target, _prompts(tmp_path), tmp_path / "a"),
        "--temperature",
        "1e-300",
    ]
    run = drift_cli.run(argv)
    assert list(run.reports) == [0.0]
    assert run.reports[0.0]["alpha_before"] == pytest.approx(1.0)
    mix = ["--temperature-mix", "1e-300:1,1e-7:1,1:2", "--fail-if-drop-above", "0"]
    run = drift_cli.run([*drift_argv(target, target, _prompts(tmp_path), tmp_path / "b"), *mix])
    assert sorted(run.reports) == [0.0, 1.0]
    assert run.gate.weights == {"0": 0.5, "1": 0.5}
    assert all(r["alpha_before"] == pytest.approx(1.0) for r in run.reports.values())


@pytest.fixture
def two_depth_head(tiny_pair, tmp_path):
    """An EAGLE-3 head on the tiny target, saved as trained at 2 depths (ttt_steps 2)."""
    from specdistill.drafts.eagle3.head import Eagle3Head
    from specdistill.models.hub import load_model, load_tokenizer

    head = Eagle3Head.from_target(load_model(str(tiny_pair[0])), aux_layers=[0, 1])
    head.ttt_steps = 2
    path = tmp_path / "head"
    head.save_pretrained(path, verifier=str(tiny_pair[0]))
    load_tokenizer(str(tiny_pair[0])).save_pretrained(path)
    return path


def test_depth_beyond_an_eagle3_drafts_trained_depths_is_one_line(
    tiny_pair, two_depth_head, tmp_path, capsys
):
    from specdistill import drafts
    from specdistill.drafts.loader import load_draft
    from specdistill.errors import run_guarded

    target, _, _ = tiny_pair
    out = tmp_path / "out"
    argv = [*drift_argv(two_depth_head, target, _prompts(tmp_path), out), "--depth", "3"]
    assert run_guarded(drift_cli.main, argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "--depth 3 is beyond the 2 depths" in lines[0] and "[1, 2]" in lines[0]
    assert not out.exists()
    head = load_draft(str(two_depth_head))
    drift_cli._check_depth(2, drafts.type_of(head), head)  # its own depths are accepted


@pytest.mark.parametrize(
    "option, value",
    [
        ("--max-new-tokens", "0"),
        ("--max-new-tokens", str(10**30)),
        ("--max-prompt-tokens", str(10**30)),
        ("--num-prompts", "0"),
        ("--num-prompts", str(10**30)),
    ],
)
def test_lengths_and_prompt_counts_past_the_machine_are_usage_errors(
    tiny_pair, tmp_path, capsys, option, value
):
    err = _usage_error(tiny_pair, tmp_path, capsys, option, value)
    assert f"argument {option}: needs an integer in [1, " in err


def test_new_tokens_beyond_the_targets_context_are_one_line(tiny_pair, tmp_path, capsys):
    from specdistill.errors import run_guarded

    target, draft, _ = tiny_pair
    out = tmp_path / "out"
    argv = [*drift_argv(draft, target, _prompts(tmp_path), out), "--max-new-tokens", "129"]
    assert run_guarded(drift_cli.main, argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "--max-new-tokens = 129 is beyond the context of" in lines[0]
    assert "128 positions" in lines[0]
    assert not out.exists()
