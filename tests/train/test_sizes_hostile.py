"""Sizes no machine or model can hold are one line before anything is written: a global
batch of 10**30, threads past 4 per core (a recipe key, a flag, OMP_NUM_THREADS), an EAGLE-3
V_d beyond the target's vocabulary, and sequence or prompt lengths beyond the target's context
(the tiny target has 128 positions)."""

import subprocess
import sys

import pytest

from specdistill import cli
from specdistill.bounds import max_threads
from specdistill.train.config import load_recipe
from specdistill.train.recipe_errors import RecipeError
from tests.train.helpers import eagle_overrides, overrides


@pytest.mark.parametrize(
    "key, value",
    [
        ("train.global_batch_size", str(10**30)),
        ("train.micro_batch_size", str(10**30)),
        ("train.threads", "1000000000"),
        ("data.max_length", str(10**30)),
        ("eval.prompts_max_tokens", str(10**30)),
    ],
)
def test_impossible_sizes_are_recipe_errors(tiny_pair, tmp_path, key, value):
    with pytest.raises(RecipeError, match=key.split(".")[1]):
        load_recipe(None, overrides(tiny_pair, tmp_path / "run", **{key: value}))


@pytest.mark.parametrize(
    "key, value", [("data.max_length", "4096"), ("eval.prompts_max_tokens", "129")]
)
def test_lengths_beyond_the_targets_context_are_refused_before_writing(
    tiny_pair, tmp_path, capsys, key, value
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f():"}\n')
    out = tmp_path / "run"
    argv = overrides(tiny_pair, out, **{key: value, "eval.prompts": str(prompts)})
    assert cli.main(["distill", *argv]) == 2
    err = capsys.readouterr().err
    assert f"{key} = {value} is beyond the context of" in err and "128 positions" in err
    assert not out.exists() or not any(out.iterdir())


def test_threads_past_four_per_core_are_one_line(tmp_path):
    """The flag, and OMP_NUM_THREADS before torch (whose OpenMP runtime would try to allocate
    them) loads: a child process, since this one has torch loaded already."""
    too_many = str(max_threads() + 1)
    code = "import sys; from specdistill import cli; sys.exit(cli.main(sys.argv[1:]))"
    argv = ["drift", "--draft", "d", "--target-before", "a", "--target-after", "b"]
    argv += ["--prompts", "p", "--out", str(tmp_path / "o")]
    flag = subprocess.run(
        [sys.executable, "-c", code, *argv, "--threads", too_many], capture_output=True, text=True
    )
    assert flag.returncode == 2 and f"needs an integer in [1, {max_threads()}]" in flag.stderr
    env = {"OMP_NUM_THREADS": "1000000000", "PATH": "/usr/bin:/bin"}
    omp = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env
    )
    assert omp.returncode == 2, omp.stderr
    assert omp.stderr.startswith("error: OMP_NUM_THREADS must be an integer in [1, ")
    assert len(omp.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("vocab_size", [321, 10000, 10**30])
def test_an_eagle3_vocabulary_beyond_the_targets_is_one_recipe_error(
    tiny_pair, tmp_path, capsys, vocab_size
):
    """A fresh EAGLE-3 head's V_d above the target's vocabulary (the tiny tokenizer has
    fewer tokens than 321) is refused before a head of that size is built, as a standalone
    draft's is."""
    out = tmp_path / "run"
    argv = eagle_overrides(tiny_pair, tiny_pair[0], out, **{"draft.vocab_size": vocab_size})
    assert cli.main(["distill", *argv]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("recipe error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("recipe error: draft.vocab_size must be an integer in [1, ")
    assert "target's vocabulary" in lines[0]
    assert not out.exists() or not any(out.iterdir())


def test_the_default_prompt_length_is_cut_to_a_shorter_context(tiny_pair, tmp_path):
    """The default eval.prompts_max_tokens (256) on the 128-position tiny target is no error
    (the user did not choose it): the run's prompts are cut to 128 tokens; a value set is
    kept."""
    from specdistill.train.trainer import Trainer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("x = 1; " * 400 + "\n")
    argv = overrides(tiny_pair, tmp_path / "run", **{"eval.prompts": str(prompts)})
    recipe = load_recipe(None, argv)
    assert recipe.eval.prompts_max_tokens == 256
    assert [len(p) for p in Trainer.from_recipe(recipe).evaluator.prompt_ids] == [128]
    recipe = load_recipe(None, [*argv, "eval.prompts_max_tokens=40"])
    assert [len(p) for p in Trainer.from_recipe(recipe).evaluator.prompt_ids] == [40]
    assert not (tmp_path / "run").exists()


def test_an_eagle3_vocabulary_other_than_the_saved_heads_is_one_recipe_error(
    tiny_pair, tmp_path, capsys
):
    from specdistill.drafts.eagle3.head import Eagle3Head
    from specdistill.models.hub import load_model

    head = Eagle3Head.from_target(load_model(str(tiny_pair[0])), aux_layers=[0, 1])
    head.save_pretrained(tmp_path / "head", verifier=str(tiny_pair[0]))
    out = tmp_path / "run"
    extra = {"draft.model": str(tmp_path / "head"), "draft.vocab_size": 200}
    assert cli.main(["distill", *eagle_overrides(tiny_pair, tiny_pair[0], out, **extra)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("recipe error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"is a head with V_d {head.draft_vocab_size}; draft.vocab_size=200 differs" in lines[0]
    assert not out.exists() or not any(out.iterdir())
