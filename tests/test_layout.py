"""The package's shape: one installed name, layers imported in one direction, no cycles.

Layers, lowest first (an arrow may only point down):

    data, losses        depend on nothing else in the project but the errors utility
    publish, errors,    utilities: atomic writes, one-line errors, the verbs' argument parser,
    verb_parser,        thread counts, bounds on numbers, the progress display of long work
    threads, bounds,    (stdlib only; errors may use publish, threads and bounds use errors,
    progress            progress uses threads)
    formats             the files the server and the online job share (the traffic record, its
                        shards, the published versions); may use errors only
    models              models whatever the draft type: loading a target, its tokenizer or any
                        causal LM, identity, the embedded and registry models, the KV stream,
                        the lean CPU forward; may use data, utilities
    drafts              what differs between draft types; may use models, losses, data,
                        utilities
    eval                may use drafts, models, formats, data, losses, utilities; never serve
                        or train
    serve, train        may use eval, formats and everything below; never each other
    online_demo         serve and train together (the online demo): everything below cli
    cli, cli_docs       dispatch to the verbs, document them (import anything, lazily)

Imports are read from the source with `ast`, deferred (function-level) imports included:
a cycle through a deferred import is still a cycle for the reader.

No module reads another's private names: `x._name` where `x` is not `self`/`cls` and nothing
called `_name` is defined in the same module (`getattr`/`hasattr`/`setattr` with a literal
`"_name"` too), except the few library internals in PRIVATE_ALLOWED, each with its reason.

Imports below a module's top level (in a function, a class or a block) are counted in every
module of the package, per top-level folder (LAZY_IMPORTS), each with a `# lazy: <reason>`
comment: the CLI's start-up, a slow dependency one path uses, a module tests replace at each
call; anything else goes to the module's top.
"""

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from collections import defaultdict
from pathlib import Path

import pytest

from tests.package_modules import REPO, modules

UTILITIES = {"publish", "errors", "verb_parser", "threads", "bounds", "progress"}
ALLOWED = {
    # specdistill/errors.py defines the project's error base classes (stdlib only)
    "data": {"errors"},
    "losses": {"errors"},
    "publish": set(),
    "errors": {"publish"},  # OutputDirError: publish imports only the standard library
    "verb_parser": set(),
    "threads": {"errors", "bounds"},  # ThreadsError, max_threads; stdlib (torch lazily)
    "bounds": {"errors"},  # BoundsError; the standard library otherwise
    "progress": {"threads"},  # usable_cores; the standard library otherwise (tqdm lazily)
    "formats": {"errors"},  # pydantic and the standard library otherwise
    # the embedded default target is built from the data layer's corpus (models/embedded.py)
    "models": {"data"} | UTILITIES,
    "drafts": {"models", "losses", "data"} | UTILITIES,
    "eval": {"data", "losses", "models", "drafts", "formats"} | UTILITIES,
    "serve": {"data", "losses", "models", "drafts", "eval", "formats"} | UTILITIES,
    "train": {"data", "losses", "models", "drafts", "eval", "formats"} | UTILITIES,
    # specdistill/online_demo/: a server and an online job run together
    "online_demo": {
        "data",
        "losses",
        "models",
        "drafts",
        "eval",
        "formats",
        "serve",
        "train",
        "root",
    }
    | UTILITIES,
    "recipes": set(),
    "root": set(),  # specdistill/__init__.py
    "cli": {
        "data",
        "losses",
        "models",
        "drafts",
        "eval",
        "formats",
        "serve",
        "train",
        "online_demo",
        "root",
    }
    | UTILITIES,
}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    if parts[1] in ("cli", "cli_docs", "__main__"):
        return "cli"
    return parts[1]


def imports(path: Path, module: str, known: set[str]) -> set[str]:
    """Project modules that `path` imports (resolved to the deepest known module)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import name`: the submodule pkg.name when there is one, else pkg
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        for name in names:
            if not name.startswith("specdistill"):
                continue
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports(p, m, known) for m, p in mods.items()}


def folder_graph(g: dict[str, set[str]]) -> str:
    edges = defaultdict(set)
    for src, dsts in g.items():
        for dst in dsts:
            if layer(src) != layer(dst):
                edges[layer(src)].add(layer(dst))
    return "\n".join(f"  {src} -> {', '.join(sorted(d))}" for src, d in sorted(edges.items()))


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(g):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_imports_follow_the_layers():
    g = graph()
    bad = [
        f"{src} imports {dst} ({layer(src)} -> {layer(dst)})"
        for src, dsts in sorted(g.items())
        for dst in sorted(dsts)
        if layer(dst) != layer(src) and layer(dst) not in ALLOWED[layer(src)]
    ]
    assert not bad, (
        "imports against the layer order:\n"
        + "\n".join(bad)
        + ("\n\nthe graph between folders:\n" + folder_graph(g))
    )


def test_no_import_cycles():
    g = graph()
    cycle = find_cycle(g)
    assert cycle is None, (
        "import cycle: "
        + " -> ".join(cycle)
        + ("\n\nthe graph between folders:\n" + folder_graph(g))
    )


def test_checks_can_fail():
    """The checkers above see a planted cycle and a planted upward arrow."""
    planted = {
        "specdistill.eval.a": {"specdistill.train.b"},
        "specdistill.train.b": {"specdistill.eval.a"},
    }
    assert find_cycle(planted) == [
        "specdistill.eval.a",
        "specdistill.train.b",
        "specdistill.eval.a",
    ]
    assert "train" not in ALLOWED[layer("specdistill.eval.a")]
    assert "drafts" not in ALLOWED[layer("specdistill.models.a")]
    assert "eval -> train" in folder_graph(planted)


def test_wheel_has_one_top_level_name(tmp_path):
    """`pip wheel .` installs `specdistill` and nothing else at the top level."""
    src = tmp_path / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(
            ".git", "runs", "build", "*.egg-info", "__pycache__", "wandb"
        ),
    )
    out = tmp_path / "wheel"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"specdistill", "specdistill-0.1.0.dist-info"}
    assert "specdistill/recipes/code.yaml" in names
    assert not [n for n in names if n.startswith("specdistill/tests/")]


@pytest.mark.parametrize("verb", ["distill", "speculate", "export"])
def test_cli_lists_and_runs_verbs(verb):
    out = subprocess.run(
        [sys.executable, "-m", "specdistill", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and verb in out.stdout
    help_ = subprocess.run(
        [sys.executable, "-m", "specdistill", verb, "--help"], capture_output=True, text=True
    )
    assert help_.returncode == 0 and "usage:" in help_.stdout


def test_cli_unknown_verb_suggests():
    out = subprocess.run(
        [sys.executable, "-m", "specdistill", "distil"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "did you mean 'distill'" in out.stderr


# name -> why reading it is allowed
PRIVATE_ALLOWED = {
    "_version": "torch's per-tensor version counter; models/lean.py checks it is there first "
    "and keeps transformers' forward when it is not (missing_internal)",
    "_attn_implementation": "transformers' attention backend on a config: the documented way "
    "to read it (read with a default)",
    "_hf_hook": "accelerate's hook attribute, tested with hasattr to refuse offloaded models",
    "_reorder_linear_weight": "oneDNN's weight prepacking op (torch.ops.mkldnn, what "
    "torch.compile's CPU backend emits); models/lean.py tries it once (packed_ops) and keeps "
    "the K-major kernel when it is missing or disagrees",
    "_linear_pointwise": "oneDNN's linear on prepacked weights (torch.ops.mkldnn); checked as "
    "_reorder_linear_weight is",
    "_exit": "os._exit, the standard library's documented exit without interpreter clean-up: "
    "train/distill.py ends a process of a multi-process run with it (leave)",
}


def defined_names(tree: ast.AST) -> set[str]:
    """Every name a module binds: functions, classes, variables, attributes it assigns,
    parameters, import aliases."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
    return names


def private_reads(source: str, where: str = "<string>") -> list[str]:
    """`where:line: expression` for each read of another module's private name in `source`."""
    tree = ast.parse(source, where)
    defined = defined_names(tree)
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            name = node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))
        ):
            name = node.args[1].value
        if (
            name
            and name.startswith("_")
            and not (name.startswith("__") and name.endswith("__"))
            and name not in defined
            and name not in PRIVATE_ALLOWED
        ):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_private_reads_can_be_found():
    source = (
        "import torch\n"
        "class A:\n"
        "    def __init__(self):\n"
        "        self._mine = 1\n"
        "    def f(self, o, tr):\n"
        "        return self._x, o._mine, tr._perms, getattr(tr, '_step'), torch._C, o.__dict__\n"
    )
    assert [line.split(": ", 1)[1] for line in private_reads(source)] == [
        "tr._perms",
        "getattr(tr, '_step')",
        "torch._C",
    ]


def test_no_module_reads_another_modules_private_names():
    found = [
        line
        for path in modules().values()
        for line in private_reads(path.read_text(), str(path.relative_to(REPO)))
    ]
    assert not found, "private names read across modules:\n" + "\n".join(found)


# ----------------------------------------------------------------------------- sizes
MAX_MODULE_LINES, MAX_CLASS_LINES = 500, 300


def oversized(source: str, where: str) -> list[str]:
    """`where` (and its classes) over the size limits: one responsibility per module."""
    found = []
    if (n := len(source.splitlines())) > MAX_MODULE_LINES:
        found.append(f"{where}: {n} lines (> {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_CLASS_LINES:
                found.append(f"{where}: class {node.name} {n} lines (> {MAX_CLASS_LINES})")
    return found


def test_size_check_can_fail():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    assert oversized(f"class Big:\n{body}\n", "big.py") == [
        f"big.py: class Big {MAX_CLASS_LINES + 1} lines (> {MAX_CLASS_LINES})"
    ]
    assert oversized("x = 1\n" * (MAX_MODULE_LINES + 1), "long.py")[0].startswith("long.py: 501")


def test_no_module_or_class_over_the_size_limits():
    found = [
        problem
        for module, path in sorted(modules().items())
        for problem in oversized(path.read_text(), str(path.relative_to(REPO)))
    ]
    assert not found, "split these:\n  " + "\n  ".join(found)


# ----------------------------------------------------------------------------- lazy imports
# Imports below a module's top level, in every module of the package, each with a
# `# lazy: <reason>` comment on its line or in the comment lines just above it; their number
# is pinned per top-level folder of the repository (LAZY_IMPORTS), so that a new one fails
# here with its folder's list. An import goes to the module's top unless something needs it
# deferred:
#   - the CLI's start-up: a verb's module and what its parser imports (the utilities,
#     eval/cli_args.py, the recipe schema train/recipe*.py) load no torch, numpy or pydantic
#     before the arguments are parsed (tests/test_cli.py runs each verb's --help);
#   - a slow dependency one path uses: matplotlib for the plots, peft for an adapter or LoRA,
#     vllm (optional) for answering with it,
#     wandb, datasets for a hub dataset, torch.distributed.tensor for FSDP2;
#   - a module looked up at each call because tests stand a fake in for it (models.hub in
#     models/target_spec.py).
LAZY_IMPORTS = {
    "data": 1,  # datasets
    "drafts": 1,  # peft
    "eval": 31,  # speculate and drift (--help: 22), matplotlib (8), vllm (optional)
    "models": 3,  # peft, the per-call hub of target_spec (2)
    "serve": 5,  # serve and convert-traffic (--help)
    "specdistill": 7,  # the utilities and the online demo (--help: 5), matplotlib (2)
    "train": 45,  # the verbs and the recipe schema (--help: 42), torch.distributed (2), peft, wandb
}
LAZY_REASON = re.compile(r"#\s*lazy:\s*\S")


def lazy_imports(source: str, where: str) -> list[tuple[str, bool]]:
    """(`where:line: import ...`, explained) for each import that is not a statement of the
    module's own body (one in a function, a class or a block); explained: a `# lazy:` comment
    with a reason ends its first line or is in the comment lines right above it."""
    lines = source.splitlines()
    tree = ast.parse(source, where)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom) or node in tree.body:
            continue
        explained = bool(LAZY_REASON.search(lines[node.lineno - 1]))
        above = node.lineno - 2
        while not explained and above >= 0 and lines[above].strip().startswith("#"):
            explained = bool(LAZY_REASON.search(lines[above]))
            above -= 1
        found.append((f"{where}:{node.lineno}: {ast.unparse(node)}", explained))
    return found


def test_lazy_import_check_can_fail():
    source = (
        "import json\n"
        "def f():\n"
        "    import torch  # lazy: heavy\n"
        "    # lazy: the trainer loads torch;\n"
        "    # the parser answers first\n"
        "    from specdistill.train import trainer\n"
        "    import numpy  # heavy\n"
        "    # lazy:\n"
        "    import pandas\n"
        "if __name__ == '__main__':\n"
        "    import sys\n"
    )
    assert [(line.split(": ", 1)[1], ok) for line, ok in lazy_imports(source, "m.py")] == [
        ("import torch", True),
        ("from specdistill.train import trainer", True),
        ("import numpy", False),
        ("import pandas", False),
        ("import sys", False),
    ]


def lazy_imports_by_folder() -> dict[str, list[tuple[str, bool]]]:
    """`lazy_imports` of every package module, by the repository's top-level folder that
    holds its file (train/online/job.py: "train"; specdistill/online_demo/: "specdistill")."""
    found = defaultdict(list)
    for path in sorted(modules().values()):
        where = path.relative_to(REPO)
        found[where.parts[0]] += lazy_imports(path.read_text(), str(where))
    return found


def test_every_lazy_import_says_why():
    found = lazy_imports_by_folder()
    unexplained = [line for items in found.values() for line, ok in items if not ok]
    assert not unexplained, (
        "imports below the top level without a `# lazy: <reason>` comment (move them to the "
        "module's top unless something needs them deferred: see LAZY_IMPORTS):\n"
        + "\n".join(unexplained)
    )
    counts = {folder: len(items) for folder, items in found.items() if items}
    wrong = [
        f"{folder}/: {counts.get(folder, 0)} lazy imports, LAZY_IMPORTS says "
        f"{LAZY_IMPORTS.get(folder, 0)}:\n  " + "\n  ".join(line for line, _ in found[folder])
        for folder in sorted(counts.keys() | LAZY_IMPORTS.keys())
        if counts.get(folder, 0) != LAZY_IMPORTS.get(folder, 0)
    ]
    assert not wrong, "\n".join(wrong)
