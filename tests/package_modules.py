"""The installed package's modules, found in the repository's folders as pyproject.toml maps
them (`[tool.setuptools.package-dir]`): module name -> source file."""

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
FOLDERS: dict[str, str] = SETUPTOOLS["package-dir"]  # subpackage -> folder in the repository


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        root = REPO / folder
        if not root.is_dir():
            continue
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if (
                package == "specdistill"
                and parts
                and parts[0] in set(FOLDERS.values()) - {"specdistill"}
            ):
                continue
            found[".".join([package, *parts])] = path
    return found
