"""Usage examples in docstrings keep their line breaks.

In a docstring that is not a raw string, a line ending in one backslash is joined to the next
one, so a shell example written across two lines reaches `--help` (and docs/cli.md) as
`... --columns draft         --out runs/x`. Examples continue a line with `\\\\`."""

import ast
from pathlib import Path

from tests.package_modules import REPO, modules


def joined_lines(path: Path) -> list[int]:
    """Line numbers of non-raw docstrings' lines that end in a single backslash."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if not isinstance(body, list) or not body:
            continue
        first = body[0]
        if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)):
            continue
        if not isinstance(first.value.value, str):
            continue
        text = ast.get_source_segment(source, first.value) or ""
        if text[:1].lower() == "r":
            continue
        for offset, line in enumerate(text.splitlines()):
            stripped = line.rstrip()
            if stripped.endswith("\\") and not stripped.endswith("\\\\"):
                found.append(first.value.lineno + offset)
    return found


def test_no_docstring_joins_an_examples_lines():
    paths = [*modules().values(), *sorted((REPO / "benchmarks").glob("*.py"))]
    bad = [f"{p.relative_to(REPO)}:{n}" for p in paths for n in joined_lines(p)]
    assert not bad, f"a single backslash ends a docstring line (write \\\\): {bad}"


def test_the_check_can_fail(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Run:\n\n    cmd --a \\\n        --b\n"""\n')
    assert joined_lines(module) == [3]
    module.write_text('r"""Run:\n\n    cmd --a \\\n        --b\n"""\n')
    assert joined_lines(module) == []
    module.write_text('"""Run:\n\n    cmd --a \\\\\n        --b\n"""\n')
    assert joined_lines(module) == []
