"""Chat requests made from the standard library: prompts for a real instruction-tuned target.

`embedded:instructions` (and `embedded:instructions-heldout`) are user turns with no answer,
for `specdistill regenerate` to answer with the target itself. Each public, documented
function of the standard library's modules of that split (data/stdlib.py; the held-out
modules stay held out) becomes up to three requests, one of each kind: a first kind chosen by
a stable hash of its qualified name, then the next of the three, then the last:

- write: "Write a Python function `name(args)` that ..." with its docstring as the spec;
- explain: "Explain what this Python function does" with its source (at most
  MAX_SOURCE_CHARS);
- use: "How do I use `module.name` in Python? ..." with its docstring, asking for an example.

Every function's first request comes before any second one, and every second before any
third, each group in a fixed shuffle, so the first N (regenerate `--limit N`) spread over the
library and a larger N only adds requests. Each request appears once (two modules can hold the
same function; a function too long to explain asks "write" in its place, which another turn
may already ask), and a held-out request is never a training one. On Python 3.11 the training
split holds 8,037 requests (5,475 of them first and second turns) and the held-out one 506.
None of them comes from the evaluation prompts in benchmarks/prompts/ (HumanEval, Spec-Bench),
which are not in the standard library.
"""

import ast
import functools
import random
import textwrap
import zlib
from pathlib import Path

from specdistill.data.stdlib import stdlib_files, stdlib_root

MIN_DOCSTRING_CHARS = 60
MAX_DOCSTRING_CHARS = 1200
MAX_SOURCE_CHARS = 1500
KINDS = ("write", "explain", "use")


@functools.cache
def stdlib_instructions(split: str = "train") -> tuple[str, ...]:
    """The user requests of `split` ("train" or "heldout"), in a fixed shuffled order."""
    turns = [[], [], []]
    for path in stdlib_files(split):
        for turn, requests in enumerate(turns):
            requests.extend(_requests(path, turn))
    for seed, requests in enumerate(turns):
        random.Random(seed).shuffle(requests)
    # a held-out request never repeats a training one (two modules can hold the same function)
    seen = set() if split == "train" else set(stdlib_instructions("train"))
    return tuple(p for p in sum(turns, []) if p not in seen and not seen.add(p))


def _requests(path: Path, turn: int) -> list[str]:
    """The requests of `path`'s documented functions; turn 0: each one's first kind, 1: its
    second, 2: its third."""
    try:
        source = path.read_text(encoding="utf-8", errors="replace")
        tree = ast.parse(source)
    except SyntaxError:  # a file for another Python version
        return []
    module = ".".join(path.relative_to(stdlib_root()).with_suffix("").parts)
    module = module.removesuffix(".__init__")
    out = []
    for node in tree.body:
        functions = [node] if isinstance(node, ast.FunctionDef) else []
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            functions = [f for f in node.body if isinstance(f, ast.FunctionDef)]
        for function in functions:
            request = _request(module, function, source, turn)
            if request:
                out.append(request)
    return out


def _request(module: str, function: ast.FunctionDef, source: str, turn: int) -> str | None:
    doc = ast.get_docstring(function)
    if function.name.startswith("_") or not doc or len(doc) < MIN_DOCSTRING_CHARS:
        return None
    doc = doc[:MAX_DOCSTRING_CHARS]
    qualified = f"{module}.{function.name}"
    kind = KINDS[(zlib.crc32(qualified.encode()) + turn) % len(KINDS)]
    if kind == "explain":
        code = textwrap.dedent(ast.get_source_segment(source, function, padded=True) or "")
        if len(code) <= MAX_SOURCE_CHARS:
            return f"Explain what this Python function does:\n\n```python\n{code.strip()}\n```"
        kind = "write"
    if kind == "write":
        args = ast.unparse(function.args)
        return (
            f"Write a Python function `{function.name}({args})` that does the following:\n\n{doc}"
        )
    return (
        f"How do I use `{qualified}` in Python? Its documentation says:\n\n{doc}\n\n"
        "Give a short example."
    )
