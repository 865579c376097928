"""Help that helps: every verb's --help names the verb, shows its examples as
`specdistill <verb>` with their line breaks and its defaults, and answers without importing a
model library; docs/cli.md is generated from the same parsers."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdistill import cli_docs
from specdistill.cli import VERBS

REPO = Path(__file__).resolve().parents[1]
COMMANDS = [command for command, _, _ in cli_docs.parsers()]
HEAVY = ("torch", "transformers", "accelerate", "peft", "numpy")

# A fresh interpreter runs `specdistill <command> --help` (argv: the heavy modules as JSON,
# then the command) and reports the exit status, the help and the heavy modules loaded.
PROBE = """
import json, sys
HEAVY, command = json.loads(sys.argv[1]), sys.argv[2:]
from contextlib import redirect_stdout
from io import StringIO
from specdistill.cli import main
out = StringIO()
with redirect_stdout(out):
    try:
        code = main(command + ["--help"])
    except SystemExit as e:
        code = e.code
print(json.dumps({"code": code, "help": out.getvalue(),
                  "loaded": [m for m in HEAVY if m in sys.modules]}))
"""


@pytest.mark.parametrize("command", COMMANDS)
def test_help_names_the_verb_and_loads_no_model_library(command):
    run = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(HEAVY), *command.split()],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    probe = json.loads(run.stdout.splitlines()[-1])
    assert probe["code"] == 0
    assert probe["help"].startswith(f"usage: specdistill {command} ")
    assert probe["loaded"] == [], f"`specdistill {command} --help` imports {probe['loaded']}"


def test_the_probe_sees_a_heavy_import():
    """The check above can fail: a module that imports torch is reported."""
    run = subprocess.run(
        [sys.executable, "-c", "import torch, sys; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.stdout.strip() == "True"


@pytest.mark.parametrize("command, verb, parser", cli_docs.parsers(), ids=COMMANDS)
def test_help_shows_examples_and_defaults(command, verb, parser):
    text = parser.format_help()
    # a docstring line ending in a single backslash loses its line break: "\    --flag"
    assert not re.search(r"\\ {2,}\S", text), "an example lost its line break"
    shown = cli_docs.examples(parser.description)
    if command != "online rollback":  # one line, no example block
        assert shown, f"{command}: no example"
        for block in shown:
            for line in block.splitlines():
                if line.startswith(("python", "accelerate", "specdistill")):
                    assert line.startswith(("specdistill", "accelerate launch")), line
        assert any(
            line.startswith(f"specdistill {command}") for b in shown for line in b.split("\n")
        )
    for action in cli_docs.actions(parser):
        assert action.help, f"{command}: {action.option_strings or action.dest} has no help"


def test_defaults_appear_in_help():
    helps = {command: p.format_help() for command, _, p in cli_docs.parsers()}
    assert "(default: 1,2,4,8)" in " ".join(helps["speculate"].split())
    assert "(default: 0.02)" in " ".join(helps["drift"].split())
    assert "(default: 64)" in " ".join(helps["cache"].split())
    assert "(default: 127.0.0.1)" in " ".join(helps["serve"].split())
    assert "(default: 11.0)" in " ".join(helps["online demo"].split())
    assert "(default: None)" not in " ".join(helps.values())
    assert "(default: False)" not in " ".join(helps.values())


def test_light_parsers_agree_with_the_modules_they_front():
    """export_cli, target_cache_cli and convert_cli hold copies of their modules' constants,
    so that --help need not import them."""
    from specdistill.serve import convert, convert_cli
    from specdistill.train import (
        export,
        export_cli,
        target_cache,
        target_cache_cli,
        target_cache_vocab,
    )

    assert convert_cli.SOURCES == convert.SOURCES

    assert export_cli.FORMATS == export.FORMATS
    assert target_cache_cli.SPLITS == target_cache.SPLITS
    assert set(target_cache_cli.VALUE_DTYPES) == set(target_cache.VALUE_DTYPES)
    assert target_cache_cli.DEFAULT_TOP_N == target_cache.DEFAULT_TOP_N
    assert target_cache_cli.COLUMNS == target_cache_vocab.COLUMNS
    assert target_cache_cli.DEFAULT_SHARD_MB * 2**20 == target_cache.DEFAULT_SHARD_BYTES


def test_every_verb_is_documented():
    assert {c.split()[0] for c in COMMANDS} == set(VERBS)
    assert {"online rollback", "online demo"} <= set(COMMANDS)


def test_reference_doc_is_the_generated_one():
    """docs/cli.md is `python -m specdistill.cli_docs` output: regenerate it after changing
    a verb's arguments."""
    committed = (REPO / cli_docs.DOC).read_text()
    assert committed == cli_docs.render(), f"stale: run {cli_docs.COMMAND}"
    for option in ("`--fail-if-drop-above` X", "`--gamma` GAMMA", "`--format` FMT"):
        assert option in committed


def test_the_reference_is_independent_of_the_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    narrow = cli_docs.render()
    monkeypatch.delenv("COLUMNS")
    assert narrow == cli_docs.render()


def test_model_loading_bars_are_hidden_and_downloads_keep_theirs(tiny_pair, capsys, monkeypatch):  # noqa: F811
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from specdistill.verb_parser import quiet_third_party

    target = tiny_pair[0]
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    hf_logging.enable_progress_bar()
    try:
        AutoModelForCausalLM.from_pretrained(target)
        assert "Loading weights" in capsys.readouterr().err  # what every verb printed
        quiet_third_party()
        AutoModelForCausalLM.from_pretrained(target)
        assert "Loading weights" not in capsys.readouterr().err
        assert not hf_logging.is_progress_bar_enabled()
        assert not are_progress_bars_disabled()  # hub downloads still show progress
    finally:
        hf_logging.enable_progress_bar()


def test_the_cpu_accelerate_config_leaves_nothing_to_warn_about(tmp_path):
    """`accelerate launch --cpu --num_processes 1` warns that values were not passed;
    recipes/accelerate/cpu.yaml passes them all (the thread count is given on the command
    line, as its header says)."""
    script = tmp_path / "script.py"
    script.write_text("print('ran')\n")

    def launch(*flags):
        return subprocess.run(
            [sys.executable, "-m", "accelerate.commands.launch", *flags, str(script)],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )

    bare = launch("--cpu", "--num_processes", "1")
    assert "were not passed to `accelerate launch`" in bare.stderr + bare.stdout
    config = REPO / "recipes" / "accelerate" / "cpu.yaml"
    assert "--num_cpu_threads_per_process" in config.read_text()
    quiet = launch("--config_file", str(config), "--num_cpu_threads_per_process", "1")
    assert quiet.returncode == 0 and "ran" in quiet.stdout, quiet.stderr
    assert "were not passed" not in quiet.stderr + quiet.stdout
