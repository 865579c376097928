"""The test suite's own shape: test modules share code through helper modules (helpers.py and
the like) and fixtures through conftest.py files, never by importing one another; and a fixture
name means one thing across the suite (two fixtures of one name have the same arguments and
code, docstrings aside)."""

import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def suite_sources() -> dict[str, str]:
    """'tests/.../name.py' -> source, for every module of the suite."""
    root = TESTS.parent
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(TESTS.rglob("*.py"))}


def module_name(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(tree: ast.Module, package: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in `tree`: `from a import b` names both `a` and
    `a.b`; relative imports are resolved against `package`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def imports_of_test_modules(sources: dict[str, str]) -> list[str]:
    """'path:line imports name' for every import of a test module (`test_*`)."""
    found = []
    for path, source in sources.items():
        module = module_name(path)
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        for line, name in imported_names(ast.parse(source), package):
            if name.rpartition(".")[2].startswith("test_"):
                found.append(f"{path}:{line} imports {name}")
    return found


def fixture_name(node: ast.FunctionDef) -> str | None:
    """The name the fixture `node` defines (its `name=` if given), or None if it is none."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if not (
            (isinstance(target, ast.Attribute) and target.attr == "fixture")
            or (isinstance(target, ast.Name) and target.id == "fixture")
        ):
            continue
        for keyword in getattr(decorator, "keywords", []):
            if keyword.arg == "name" and isinstance(keyword.value, ast.Constant):
                return keyword.value.value
        return node.name
    return None


def meaning(node: ast.FunctionDef) -> str:
    """The fixture's arguments and code (its docstring left out), as `ast.dump` writes them."""
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    return ast.dump(node.args) + ast.dump(ast.Module(body=body, type_ignores=[]))


def fixture_clashes(sources: dict[str, str]) -> list[str]:
    """'name: path:line, path:line' for every fixture name defined with different code."""
    where: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                name = fixture_name(node)
                if name is not None:
                    where[name][meaning(node)].append(f"{path}:{node.lineno}")
    return [
        f"{name}: " + ", ".join(place for places in meanings.values() for place in places)
        for name, meanings in sorted(where.items())
        if len(meanings) > 1
    ]


def test_no_test_module_imports_another():
    imports = imports_of_test_modules(suite_sources())
    assert not imports, (
        "a test module is imported (move what is shared into a helper module or, for a "
        "fixture, a conftest.py):\n" + "\n".join(imports)
    )


def test_a_fixture_name_has_one_meaning():
    clashes = fixture_clashes(suite_sources())
    assert not clashes, (
        "fixtures of one name with different code (name each for what it is, or share one in "
        "a conftest.py):\n" + "\n".join(clashes)
    )


def test_the_checks_can_fail():
    importers = {
        "tests/train/test_a.py": "from .test_b import helper\n",
        "tests/train/test_c.py": "from tests.train import test_b\n",
        "tests/eval/test_d.py": "import tests.train.test_b\n",
        "tests/train/helpers.py": "from tests.train.test_b import helper\n",
        "tests/train/test_e.py": "from tests.train.helpers import helper\nfrom . import helpers\n",
    }
    assert imports_of_test_modules(importers) == [
        "tests/train/test_a.py:1 imports tests.train.test_b",
        "tests/train/test_c.py:1 imports tests.train.test_b",
        "tests/eval/test_d.py:1 imports tests.train.test_b",
        "tests/train/helpers.py:1 imports tests.train.test_b",
    ]
    fixture = "import pytest\n\n@pytest.fixture{args}\ndef {name}():\n    {body}\n"
    fixtures = {
        "tests/a/test_a.py": fixture.format(args="", name="pair", body="return 1"),
        "tests/b/test_b.py": fixture.format(args="(scope='module')", name="pair", body="return 2"),
        "tests/c/test_c.py": fixture.format(args="", name="same", body='"""A."""; return 3'),
        "tests/d/test_d.py": fixture.format(args="", name="same", body='"""B."""; return 3'),
        "tests/e/test_e.py": fixture.format(args="(name='pair')", name="other", body="return 1"),
        "tests/f/test_f.py": "def pair():\n    return 4\n",  # not a fixture
    }
    places = "tests/a/test_a.py:4, tests/e/test_e.py:4, tests/b/test_b.py:4"
    assert fixture_clashes(fixtures) == [f"pair: {places}"]
