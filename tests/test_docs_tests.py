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
    """README.md and docs/*.md name files by their paths in the repository (`models/lean.py`,
    `recipes/code.yaml`): every such path exists, so a moved module cannot leave a stale
    pointer behind."""
    root = Path(__file__).resolve().parents[1]
    pattern = re.compile(
        r"(?<![\w/.-])((?:data|losses|models|drafts|eval|serve|train|specdistill|benchmarks|tests|"
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
    # a link to a RESULTS.md section carries the header's date in its anchor: not a date here
    results_link = re.compile(r"\]\([^)\s]*RESULTS\.md#[^)\s]*\)")
    hits = [
        f"{doc.relative_to(REPO)}:{number}"
        for doc in _docs()
        if doc.name != "RESULTS.md"
        for number, line in enumerate(doc.read_text().splitlines(), 1)
        if date.search(results_link.sub("]()", line))
    ]
    assert not hits, hits


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower-case, punctuation removed (letters,
    digits, '_', '-' and spaces kept), spaces to '-', '-1', '-2'... on repeats; code blocks
    hold no headings."""
    anchors, seen, in_code = set(), {}, False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            in_code = not in_code
            continue
        heading = None if in_code else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_every_anchor_in_the_docs_names_a_heading():
    """A link to a section (`[x](../benchmarks/RESULTS.md#parallel-drafts-2026-12-02)`,
    `[x](#specdistill-serve)`) names a heading of that page as GitHub spells its anchor, so a
    renamed or re-dated section cannot leave a link that opens the page at its top."""
    link = re.compile(r"\]\(([^)\s]*#[^)\s]+)\)")
    broken = []
    for doc in _docs():
        for target in link.findall(doc.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            page = doc.parent / path if path else doc
            if page.suffix == ".md" and anchor not in _anchors(page.read_text()):
                broken.append(f"{doc.relative_to(REPO)}: {target}")
    assert not broken, "anchors that name no heading:\n  " + "\n  ".join(broken)


def test_the_anchor_rule_is_github_s():
    text = "# A `b` (c, 2026-12-02)\n```\n# not a heading\n```\n## Don't: x_y\n## Don't: x_y\n"
    assert _anchors(text) == {"a-b-c-2026-12-02", "dont-x_y", "dont-x_y-1"}
