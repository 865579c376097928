"""A user's project with its own `data/`, `eval/`, `train/` and `losses/` packages shadows
nothing of specdistill's, and specdistill shadows nothing of theirs: everything we install
lives under the one name `specdistill`."""

import json
import subprocess
import sys
from pathlib import Path

from tests.train.helpers import overrides

USER_PACKAGES = ("data", "eval", "train", "losses", "recipes")


def user_project(root: Path) -> Path:
    """A working directory whose top-level packages would break us if they were imported."""
    for name in USER_PACKAGES:
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(
            f"raise ImportError('the user project\\'s own {name} package was imported')\n"
        )
    return root


def test_the_trainer_runs_from_a_project_with_its_own_data_and_eval(tiny_pair, tmp_path):
    cwd = user_project(tmp_path / "project")
    out = tmp_path / "run"
    args = overrides(tiny_pair, out, **{"train.max_steps": 2})
    # `python -m` puts the working directory first on sys.path: the strongest shadowing case.
    run = subprocess.run(
        [sys.executable, "-m", "specdistill", "distill", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((out / "eval.json").read_text())["steps"] == 2


def test_the_user_packages_stay_theirs(tmp_path):
    cwd = user_project(tmp_path / "project")
    probe = (
        "import specdistill.data, specdistill.eval.engine, specdistill.train.config\n"
        "try:\n    import data\nexcept ImportError as e:\n    print(e)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "the user project's own data package was imported" in run.stdout
