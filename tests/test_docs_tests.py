"""Each guarantee in docs/reliability.md names the test that checks it: that test exists."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _docs() -> list[Path]:
    """README.md, benchmarks/RESULTS.md and every page under docs/."""
    return [
        REPO / "README.md",
        REPO / "benchmarks" / "RESULTS.md",
        *sorted(REPO.glob("docs/**/*.md")),
    ]


def test_every_test_named_in_reliability_md_exists():
    text = (REPO / "docs" / "reliability.md").read_text()
    named = re.findall(r"(tests/[\w/]+\.py)::(\w+)", text)
    assert len(named) > 50
    missing = [
        f"{path}::{name}"
        for path, name in named
        if not (REPO / path).is_file() or f"def {name}(" not in (REPO / path).read_text()
    ]
    assert not missing, missing


def test_every_source_file_named_in_the_docs_exists():
    """README.md and docs/*.md name files by their paths in the repository (`drafts/lean.py`,
    `recipes/code.yaml`): every such path exists, so a moved module cannot leave a stale
    pointer behind."""
    root = Path(__file__).resolve().parents[1]
    pattern = re.compile(
        r"(?<![\w/.-])((?:data|losses|drafts|eval|serve|train|specdistill|benchmarks|tests|"
        r"recipes)/[\w/.-]*\.(?:py|yaml))"
    )
    missing = [
        f"{doc.relative_to(root)}:{number}: {path}"
        for doc in _docs()
        for number, line in enumerate(doc.read_text().splitlines(), 1)
        for path in pattern.findall(line)
        if not (root / path).exists()
    ]
    assert not missing, "named in the docs but not in the repository:\n  " + "\n  ".join(missing)


def test_every_relative_link_in_the_docs_resolves():
    """A Markdown link to another page or file of the repository (`[x](docs/theory.md)`,
    `[x](../benchmarks/RESULTS.md#section)`) points at a file that exists."""
    link = re.compile(r"\]\(([^)\s]+)\)")
    missing = [
        f"{doc.relative_to(REPO)}: {target}"
        for doc in _docs()
        for target in link.findall(doc.read_text())
        if not target.startswith(("http://", "https://", "mailto:", "#"))
        and not (doc.parent / target.split("#", 1)[0]).exists()
    ]
    assert not missing, "links to nothing:\n  " + "\n  ".join(missing)


def test_no_issue_numbers_in_the_readme_or_docs():
    """The README and docs describe the project as it is, not the history of its issues."""
    hits = [
        f"{doc.relative_to(REPO)}:{number}"
        for doc in _docs()
        for number, line in enumerate(doc.read_text().splitlines(), 1)
        if re.search(r"\bissues? #?\d+", line, re.IGNORECASE)
    ]
    assert not hits, hits


def test_no_dates_in_the_readme_or_docs():
    """Dates belong to benchmarks/RESULTS.md's section headers, once per measurement; the
    README and docs describe the project as it is."""
    date = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
    hits = [
        f"{doc.relative_to(REPO)}:{number}"
        for doc in _docs()
        if doc.name != "RESULTS.md"
        for number, line in enumerate(doc.read_text().splitlines(), 1)
        if date.search(line)
    ]
    assert not hits, hits
