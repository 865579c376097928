"""Anticipated errors name what is wrong in one line: recipe values, model paths, the hub,
and the script entry points (one line on stderr, exit 2; the traceback with --debug)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdistill.drafts.loader import load_draft
from specdistill.errors import run_guarded
from specdistill.models import hub
from specdistill.models.hub import ModelNotFoundError, load_model, load_tokenizer
from specdistill.train import distill
from specdistill.train.config import RecipeError, load_recipe
from tests.processes import free_port

REPO = Path(__file__).resolve().parents[2]
LOADERS = [load_tokenizer, load_model, load_draft]


# 9: batch sizes --------------------------------------------------------------------------


def test_zero_batch_sizes_are_recipe_errors():
    with pytest.raises(
        RecipeError, match=r"train\.micro_batch_size must be in \[1, 1048576\], got 0"
    ):
        load_recipe(None, ["train.micro_batch_size=0"])
    with pytest.raises(
        RecipeError, match=r"train\.global_batch_size must be in \[1, 1048576\], got 0"
    ):
        load_recipe(None, ["train.global_batch_size=0"])


# 10: loss parameters ---------------------------------------------------------------------


def test_loss_param_of_the_wrong_type_names_the_key_and_type():
    with pytest.raises(RecipeError, match=r"loss\.beta must be a number, got 'abc'"):
        load_recipe(None, ["loss.name=jsd", "loss.beta=abc"])
    with pytest.raises(RecipeError, match=r"loss\.k must be an integer, got 2\.5"):
        load_recipe(None, ["loss.name=topk_ce", "loss.k=2.5"])
    with pytest.raises(RecipeError, match=r"loss\.parts\.tv must be a number, got 'lots'"):
        load_recipe(None, ["loss.name=mix", "loss.parts={tv: lots, fkl: 0.1}"])


def test_loss_param_values_are_coerced_to_the_signature_type():
    recipe = load_recipe(None, ["loss.name=jsd", "loss.beta=1e-1", "loss.top_k=5"])
    assert recipe.loss.params == {"beta": 0.1, "top_k": 5}
    mix = load_recipe(None, ["loss.name=mix", "loss.parts={tv: 1, jsd: 1}", "loss.beta=0.25"])
    assert mix.loss.params == {"parts": {"tv": 1.0, "jsd": 1.0}, "beta": 0.25}


def test_unknown_loss_param_or_name_suggests_the_close_one():
    with pytest.raises(RecipeError, match=r"jsd takes no parameter 'loss\.bta'.*'loss\.beta'"):
        load_recipe(None, ["loss.name=jsd", "loss.bta=0.3"])
    with pytest.raises(RecipeError, match=r"did you mean 'loss\.temperature'"):
        load_recipe(None, ["loss.temprature=2"])
    with pytest.raises(RecipeError, match=r"loss\.name must be one of .*'jds'; did you mean 'jsd'"):
        load_recipe(None, ["loss.name=jds"])
    with pytest.raises(RecipeError, match=r"unknown part 'tvv'; did you mean 'tv'"):
        load_recipe(None, ["loss.name=mix", "loss.parts={tvv: 1}"])


# 11: empty recipe ------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n"])
def test_empty_recipe_file_is_an_error(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError, match=f"{path}: recipe is empty"):
        load_recipe(path)


# 12: local model paths -------------------------------------------------------------------


@pytest.mark.parametrize("loader", LOADERS)
def test_missing_model_directory_is_named(tmp_path, monkeypatch, loader):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    names = [
        str(tmp_path / "no-such-model"),
        "./no-such-model",
        "no-such-model/",
        "runs/code",  # its first part exists: a path, not a hub id
        "runs/code/final",  # a hub id has a single slash
    ]
    for name in names:
        with pytest.raises(ModelNotFoundError, match=f"^{name}: no such directory$"):
            loader(name)
    assert issubclass(ModelNotFoundError, OSError)


@pytest.mark.parametrize("loader", LOADERS)
def test_directory_without_config_is_not_a_model(tmp_path, loader):
    final = tmp_path / "final"
    final.mkdir()
    (final / "tokenizer.json").write_text("{}")  # a save that stopped half-way
    with pytest.raises(ModelNotFoundError, match="final: not a model directory: config.json"):
        loader(str(final))


def test_model_directories_embedded_names_and_hub_ids_still_resolve(tiny_pair, monkeypatch):
    target, draft, _ = tiny_pair
    assert len(load_tokenizer(str(target))) > 0
    assert load_draft(str(draft)).config.num_hidden_layers == 1
    monkeypatch.setattr(hub, "resolve_model", lambda name: str(target))
    assert hub.local_model_dir("embedded:code") == str(target)
    assert hub.local_model_dir("Qwen/Qwen2.5-0.5B") is None  # a hub id


# 19: the hub when offline ----------------------------------------------------------------


def _no_connectivity_check():
    raise AssertionError("HF_HUB_OFFLINE is set: the hub must not be contacted")


@pytest.mark.parametrize("loader", [load_tokenizer, load_model])
def test_hub_offline_fails_fast(monkeypatch, loader):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "hub_reachable", _no_connectivity_check)
    start = time.monotonic()
    with pytest.raises(ModelNotFoundError, match="some-org/some-model: .*hub is unreachable"):
        loader("some-org/some-model")
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("loader", [load_tokenizer, load_model])
def test_unreachable_hub_fails_fast(monkeypatch, loader):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)
    start = time.monotonic()
    with pytest.raises(ModelNotFoundError, match="hub is unreachable .*pass a local model dir"):
        loader("some-org/some-model")
    assert time.monotonic() - start < 5


def test_connectivity_check_uses_hf_endpoint(monkeypatch):
    port = free_port()
    for key in ("HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    assert hub.hub_address() == ("127.0.0.1", port)
    hub.hub_reachable.cache_clear()
    try:
        start = time.monotonic()
        assert hub.hub_reachable() is False
        assert time.monotonic() - start < 3
    finally:
        hub.hub_reachable.cache_clear()


# 13: scripts: one line and exit 2, the traceback with --debug -----------------------------


def _recipe(tmp_path: Path, target: str, draft: str, data: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"target: {{model: '{target}'}}\n"
        f"draft: {{model: '{draft}'}}\n"
        f"data: {{train: ['{data}'], max_length: 16}}\n"
        f"train: {{max_steps: 1, global_batch_size: 2, micro_batch_size: 2, warmup_steps: 0,\n"
        f"        output_dir: '{tmp_path / 'run'}'}}\n"
        "eval: {every: 0, max_sequences: 2}\n"
    )
    return path


def _run(*args: str, debug: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SPECDISTILL_DEBUG"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    if debug:
        env["SPECDISTILL_DEBUG"] = "1"
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def test_distill_script_missing_model_is_one_line(tmp_path):
    missing = tmp_path / "no-such-model"
    recipe = _recipe(tmp_path, str(missing), str(missing), str(tmp_path / "missing.jsonl"))
    result = _run("train/distill.py", "--recipe", str(recipe))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"error: {missing}: no such directory"]

    debug = _run("train/distill.py", "--recipe", str(recipe), debug=True)
    assert debug.returncode not in (0, 2)
    assert "Traceback (most recent call last)" in debug.stderr
    assert "ModelNotFoundError" in debug.stderr


def test_distill_script_missing_data_is_one_line(tmp_path, tiny_pair):
    target, draft, _ = tiny_pair
    data = tmp_path / "missing.jsonl"
    result = _run("train/distill.py", "--recipe", str(_recipe(tmp_path, target, draft, data)))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr  # above the error: the models' loading progress
    assert result.stderr.strip().splitlines()[-1] == f"error: {data}: no such file or directory"


def test_distill_debug_flag_shows_the_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDISTILL_DEBUG", "0")  # restored after the test
    missing = str(tmp_path / "no-such-model")
    recipe = str(_recipe(tmp_path, missing, missing, "embedded:code"))
    assert run_guarded(distill.main, ["--recipe", recipe]) == 2
    assert capsys.readouterr().err == f"error: {missing}: no such directory\n"
    with pytest.raises(ModelNotFoundError):
        run_guarded(distill.main, ["--debug", "--recipe", recipe])
    with pytest.raises(RecipeError, match="train.max_stepz"):
        run_guarded(distill.main, ["--debug", "train.max_stepz=3"])


@pytest.mark.parametrize("script", ["eval/speculative.py", "-m specdistill.train.export"])
def test_other_scripts_report_one_line(tmp_path, script):
    missing = str(tmp_path / "no-such-model")
    if script.endswith("export"):
        args = ["--draft", missing, "--format", "hf", "--out", str(tmp_path / "out")]
    else:
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("def f(x):\n")
        args = ["--target", missing, "--draft", missing, "--prompts", str(prompts)]
        args += ["--out", str(tmp_path / "out")]
    result = _run(*script.split(), *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and missing in lines[0], lines
