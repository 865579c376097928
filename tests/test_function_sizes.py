"""No function outside tests/ is over MAX_FUNCTION_LINES lines: a longer one is split into
named steps (small functions, or a small dataclass carrying the state between them).

A function's length is `end_lineno - lineno + 1` from `ast` (its decorators not counted); a
nested function counts on its own and inside the function that holds it. The modules are
the installed package's (test_layout.py's `modules`) and the benchmarks.
"""

import ast
from pathlib import Path

from tests.package_modules import REPO, modules

MAX_FUNCTION_LINES = 80


def checked_files() -> list[Path]:
    """Every package module, then every benchmark script."""
    return sorted(set(modules().values()) | set((REPO / "benchmarks").rglob("*.py")))


def long_functions(source: str, where: str) -> list[str]:
    """`where`'s functions over the limit, each as `where: Class.name N lines (> limit)`."""
    found = []

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{scope}{child.name}"
                n = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and n > MAX_FUNCTION_LINES:
                    found.append(f"{where}: {name} {n} lines (> {MAX_FUNCTION_LINES})")
                visit(child, f"{name}.")
            else:
                visit(child, scope)

    visit(ast.parse(source), "")
    return found


def statements(n: int, indent: str) -> str:
    return "\n".join(f"{indent}x{i} = {i}" for i in range(n))


def test_function_size_check_can_fail():
    method = f"class Big:\n    def method(self):\n{statements(MAX_FUNCTION_LINES, ' ' * 8)}\n"
    assert long_functions(method, "big.py") == [
        f"big.py: Big.method {MAX_FUNCTION_LINES + 1} lines (> {MAX_FUNCTION_LINES})"
    ]
    nested = f"def outer():\n    def inner():\n{statements(MAX_FUNCTION_LINES, ' ' * 8)}\n"
    assert long_functions(nested, "n.py") == [
        f"n.py: outer {MAX_FUNCTION_LINES + 2} lines (> {MAX_FUNCTION_LINES})",
        f"n.py: outer.inner {MAX_FUNCTION_LINES + 1} lines (> {MAX_FUNCTION_LINES})",
    ]


def test_decorators_and_a_function_at_the_limit_pass():
    source = f"@decorator\n@another\ndef f():\n{statements(MAX_FUNCTION_LINES - 1, ' ' * 4)}\n"
    assert long_functions(source, "f.py") == []


def test_the_checked_files_include_every_layer_and_the_benchmarks():
    folders = {path.relative_to(REPO).parts[0] for path in checked_files()}
    assert {"specdistill", "eval", "train", "serve", "models", "drafts", "benchmarks"} <= folders
    assert "tests" not in folders


def test_no_function_over_the_size_limit():
    found = [
        problem
        for path in checked_files()
        for problem in long_functions(path.read_text(), str(path.relative_to(REPO)))
    ]
    assert not found, "split these into named steps:\n  " + "\n  ".join(found)
