"""The embedded corpora: text that ships with the running interpreter.

`code`: the Python standard-library sources. `prose`: the English that ships with them, the
docstrings of those modules and the interpreter's help topics (`stdlib_prose`), so a second
embedded pair can be trained on something other than code. Every machine that runs
specdistill has these files, so the embedded defaults need no download. Test suites (folders
named `test` / `tests`) and site-packages are excluded. The held-out split is by top-level
module (``email/*`` all land on one side), chosen by a stable hash of the module name, so it
is the same on every machine with the same Python.
"""

import ast
import functools
import os
import random
import sysconfig
import zlib
from pathlib import Path
from pydoc_data.topics import topics

HELDOUT_PERCENT = 5
_EXCLUDED_DIRS = {"test", "tests", "site-packages", "dist-packages", "__pycache__", "idlelib"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_heldout(relpath: Path) -> bool:
    module = relpath.parts[0].removesuffix(".py")
    return zlib.crc32(module.encode()) % 100 < HELDOUT_PERCENT


def stdlib_files(split: str = "train") -> list[Path]:
    """Sorted `.py` files of the standard library for `split` in {"train", "heldout", "all"}."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    root = stdlib_root()
    files = []
    for path in sorted(_python_files(root)):
        rel = path.relative_to(root)
        if split == "all" or (split == "heldout") == _is_heldout(rel):
            files.append(path)
    if not files:
        raise FileNotFoundError(f"no standard-library sources for split {split!r} under {root}")
    return files


def _python_files(root: Path) -> list[Path]:
    """`.py` files under `root`, not descending into excluded folders (site-packages is big)."""
    found = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _EXCLUDED_DIRS]
        found.extend(Path(folder, name) for name in names if name.endswith(".py"))
    return found


def help_topics() -> tuple[list[str], list[str]]:
    """(fine-tune, held-out) texts of the interpreter's help topics (`pydoc_data.topics`):
    English prose about the language, the demos' second domain. The topics are split 4:1 by a
    fixed shuffle of their names, the same on every machine with the same Python."""
    names = sorted(topics)
    random.Random(0).shuffle(names)
    cut = len(names) * 4 // 5
    return [topics[n] for n in names[:cut]], [topics[n] for n in names[cut:]]


MIN_DOCSTRING_CHARS = 40  # shorter ones are mostly "Return self." and the like


@functools.cache
def stdlib_prose(split: str = "train") -> tuple[str, ...]:
    """English documents for `split` in {"train", "heldout"}: one per module of that split
    of `stdlib_files` (its module, class and function docstrings, in `ast.walk` order, blank-
    line separated; no code), then the help topics of that side of `help_topics()`. No text
    is on both sides. About 1.9 MB for "train" and 0.24 MB for "heldout" on CPython 3.11."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    documents = [d for d in map(_docstrings, stdlib_files(split)) if d]
    fine_tune, heldout = help_topics()
    return tuple(documents + (fine_tune if split == "train" else heldout))


def _docstrings(path: Path) -> str:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except SyntaxError:  # a file for another Python version (lib2to3 fixtures and the like)
        return ""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = [ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds)]
    return "\n\n".join(d for d in found if d and len(d) >= MIN_DOCSTRING_CHARS)
