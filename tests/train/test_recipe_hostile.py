"""Hostile recipes for `specdistill distill`: a seed out of range, keys nested 100,000 deep in
the file or an override, a binary or UTF-16 file, a key written twice, a train.output_dir
under a file: each is one `recipe error:` line and exit 2, before anything loads."""

import pytest

from specdistill import cli
from specdistill.train import distill
from specdistill.train.config import RecipeError, load_recipe
from tests.train.helpers import overrides

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("value", ["-1", str(2**32), "123456789012345678901234"])
def test_a_seed_outside_32_bits_is_a_recipe_error(value):
    with pytest.raises(
        RecipeError, match=rf"^train\.seed must be in \[0, 4294967295\], got {value}"
    ):
        load_recipe(None, [f"train.seed={value}"])
    assert load_recipe(None, [f"train.seed={2**32 - 1}"]).train.seed == 2**32 - 1


def test_a_seed_outside_32_bits_exits_2_in_one_line(tmp_path, capsys):
    argv = [f"train.output_dir={tmp_path / 'run'}", "train.seed=-1"]
    assert distill.main(argv) == 2
    err = capsys.readouterr().err
    assert err == "recipe error: train.seed must be in [0, 4294967295], got -1\n"
    assert not (tmp_path / "run").exists()


def test_data_train_nested_100000_deep_is_a_recipe_error(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text(f"data:\n  train: {DEEP}\n")
    with pytest.raises(RecipeError, match=rf"^{path}: nested too deeply to read"):
        load_recipe(path)
    with pytest.raises(RecipeError, match=r"^override data\.train=\.\.\.: nested too deeply"):
        load_recipe(None, [f"data.train={DEEP}"])


@pytest.mark.parametrize(
    "content, message",
    [
        ("train:\n  max_steps: 2\n".encode("utf-16"), ": UTF-16 text; save the recipe as UTF-8"),
        (b"train:\n  max_steps: 2\n\x80\x81\x00\xff", ":3: not UTF-8 \\(invalid start byte"),
    ],
)
def test_a_binary_or_utf16_recipe_is_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(content)
    with pytest.raises(RecipeError, match=f"^{path}{message}"):
        load_recipe(path)
    assert distill.main(["--recipe", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"recipe error: {path}") and err.count("\n") == 1


@pytest.mark.parametrize(
    "text, line, key, first",
    [
        ("train:\n  max_steps: 2\n  lr: 0.1\n  max_steps: 3\n", 4, "max_steps", 2),
        ("train:\n  max_steps: 2\ntrain:\n  lr: 0.1\n", 3, "train", 1),
        ("data:\n  train: {path: a, path: b}\n", 2, "path", 2),
    ],
)
def test_a_key_written_twice_is_refused_naming_file_and_line(
    tmp_path, capsys, text, line, key, first
):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    message = rf"^{path}:{line}: key '{key}' is written twice in one mapping \(also at line "
    message += rf"{first}\)"
    with pytest.raises(RecipeError, match=message):
        load_recipe(path)
    out = tmp_path / "run"
    assert distill.main(["--recipe", str(path), f"train.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"recipe error: {path}:{line}: ") and err.count("\n") == 1
    assert not out.exists()


def test_a_merge_key_may_still_be_overridden(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("base: &b {max_steps: 2, lr: 0.1}\ntrain:\n  <<: *b\n  max_steps: 3\n")
    with pytest.raises(RecipeError) as info:  # the unknown section `base`, not a duplicate
        load_recipe(path)
    assert "twice" not in str(info.value) and "base" in str(info.value)


def test_an_output_dir_under_a_file_is_one_line(tiny_pair, tmp_path, capsys):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a directory\n")
    out = blocker / "runs" / "run"
    assert cli.main(["distill", *overrides(tiny_pair, out)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"recipe error: train.output_dir {out} lies under {blocker}, which is not a "
        "directory; choose a train.output_dir under a directory\n"
    )
    assert blocker.read_text() == "a file, not a directory\n"
