"""specdistill/errors.py: the project's own errors (and a missing file) are one line and exit 2;
any other exception is a bug and keeps its traceback. Every error class the package defines
is one of the project's own."""

import ast
import importlib
import subprocess
import sys

import pytest

from specdistill.errors import ANTICIPATED, UserError, UserFileError, run_guarded
from specdistill.publish import OutputDirError
from tests.package_modules import REPO, modules

# Error classes that never reach a command line, with the reason.
NOT_USER_ERRORS = {
    "specdistill.serve.errors.APIError": "an HTTP error answered to the client by the server",
}


def raising(exc):
    def main(argv):
        raise exc

    return main


@pytest.mark.parametrize(
    "exc",
    [
        UserError("recipe.yaml:3: bad value"),
        UserFileError(2, "No such file or directory", "data/x.jsonl"),
        OutputDirError("runs/x holds files; give --overwrite"),
        FileNotFoundError(2, "No such file or directory", "prompts.jsonl"),
    ],
)
def test_the_projects_errors_are_one_line_and_exit_2(exc, capsys, monkeypatch):
    monkeypatch.delenv("SPECDISTILL_DEBUG", raising=False)
    assert run_guarded(raising(exc), []) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_a_recipe_error_says_so(capsys, monkeypatch):
    from specdistill.train.config import RecipeError

    monkeypatch.delenv("SPECDISTILL_DEBUG", raising=False)
    assert run_guarded(raising(RecipeError("train.lr: -1 is not > 0")), []) == 2
    assert capsys.readouterr().err == "recipe error: train.lr: -1 is not > 0\n"


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("too many values to unpack"),
        OSError(28, "No space left on device"),
        KeyError("alpha"),
        TypeError("unsupported operand"),
    ],
)
def test_any_other_exception_is_a_bug_and_propagates(exc, monkeypatch):
    monkeypatch.delenv("SPECDISTILL_DEBUG", raising=False)
    with pytest.raises(type(exc)):
        run_guarded(raising(exc), [])


def test_debug_shows_the_traceback_of_a_user_error(monkeypatch):
    monkeypatch.setenv("SPECDISTILL_DEBUG", "1")
    with pytest.raises(UserError):
        run_guarded(raising(UserError("x")), [])


def test_a_bug_prints_its_traceback_from_the_command_line(tmp_path):
    """A verb whose main raises a plain ValueError: Python's traceback, not one line."""
    script = (
        "import sys\n"
        "from specdistill.errors import run_guarded\n"
        "def main(argv):\n"
        "    raise ValueError('a bug')\n"
        "sys.exit(run_guarded(main, []))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 1
    assert "Traceback (most recent call last)" in out.stderr
    assert "ValueError: a bug" in out.stderr and "error: a bug" not in out.stderr


def error_classes() -> list[str]:
    """'module.Class' for every class named *Error defined in the package."""
    found = []
    for module, path in sorted(modules().items()):
        if path.is_relative_to(REPO / "specdistill" / "recipes"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        found += [
            f"{module}.{node.name}"
            for node in tree.body
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error")
        ]
    return found


def test_every_error_class_is_one_of_the_projects_own():
    names = error_classes()
    assert "specdistill.train.recipe_errors.RecipeError" in names and len(names) > 10
    wrong = []
    for name in names:
        if name in NOT_USER_ERRORS:
            continue
        module, _, cls = name.rpartition(".")
        if not issubclass(getattr(importlib.import_module(module), cls), ANTICIPATED):
            wrong.append(name)
    assert not wrong, f"not one of specdistill/errors.py ANTICIPATED: {wrong}"
