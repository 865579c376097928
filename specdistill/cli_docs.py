"""docs/cli.md: every verb's options, generated from the parsers the verbs themselves use.

    python -m specdistill.cli_docs > docs/cli.md

Each verb module (specdistill/cli.py `VERBS`) builds its parser in `build_parser()`, and
`specdistill online`'s subcommands in `SUBVERBS` (or in a module of their own:
specdistill/cli.py `SUBCOMMANDS`); none of them imports a model library, so
this runs in a fraction of a second. tests/test_cli.py fails when docs/cli.md is not this
module's output.
"""

import argparse
import importlib
import os
import sys

from specdistill.cli import SUBCOMMANDS, VERBS

DOC = "docs/cli.md"
COMMAND = "python -m specdistill.cli_docs > docs/cli.md"
WIDTH = "100"  # the usage lines' width, whatever the terminal's


def parsers() -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(command, one line, parser) for every verb and subcommand, in VERBS order."""
    found = []
    for verb, (module_name, line) in VERBS.items():
        module = importlib.import_module(module_name)
        found.append((verb, line, module.build_parser()))
        builders = dict(getattr(module, "SUBVERBS", {}))
        for (owner, sub), name in SUBCOMMANDS.items():
            if owner == verb:
                builders[sub] = importlib.import_module(name).build_parser
        for sub, build in builders.items():
            found.append((f"{verb} {sub}", build().description.split("\n\n")[0], build()))
    return found


def examples(description: str | None) -> list[str]:
    """The description's indented blocks that show a `specdistill` command."""
    blocks = (description or "").split("\n\n")
    return [
        "\n".join(line[4:] for line in block.splitlines())
        for block in blocks
        if block.startswith("    ")
        and all(line.startswith("    ") for line in block.splitlines())
        and "specdistill " in block
    ]


def _cell(text) -> str:
    """One table cell: one line, `|` escaped, `<name>` shown rather than read as HTML."""
    text = " ".join(str(text).split())
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _default(action: argparse.Action) -> str:
    default = action.default
    if default is None or default is False or default is argparse.SUPPRESS:
        return ""
    if isinstance(default, list | tuple):
        return f"`{','.join(map(str, default))}`" if default else ""
    return f"`{default}`"


def actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's arguments in --help's order, as its help formatter receives them
    (argparse has no public list of them)."""
    collected: list[argparse.Action] = []

    class Collect(argparse.HelpFormatter):
        def add_arguments(self, group_actions):
            collected.extend(group_actions)

    saved = parser.formatter_class
    parser.formatter_class = Collect
    try:
        parser.format_help()
    finally:
        parser.formatter_class = saved
    return [a for a in collected if "--help" not in a.option_strings]


def options(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for action in actions(parser):
        if action.option_strings:
            name = ", ".join(f"`{o}`" for o in action.option_strings)
            if action.nargs != 0:
                metavar = action.metavar or action.dest.upper()
                name += f" {_cell(metavar)}"
        else:
            name = f"`{action.metavar or action.dest}`" + (" ..." if action.nargs == "*" else "")
        meaning = _cell(action.help or "")
        if action.choices:
            meaning += f" (one of: {', '.join(f'`{c}`' for c in action.choices)})"
        if action.required and action.nargs not in ("?", "*"):
            meaning = "**required**; " + meaning
        rows.append(f"| {name} | {_default(action)} | {meaning} |")
    return rows


def render() -> str:
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        lines = [
            "# Command-line reference",
            "",
            "Every `specdistill` verb and its options, generated from the parsers the verbs "
            f"use (`{COMMAND}`; a test fails when this page is stale). `specdistill <verb> "
            "--help` prints the same with the verb's full description. Anticipated errors exit "
            "with status 2 and one line (`--debug` before the verb shows the traceback).",
            "",
        ]
        found = parsers()
        lines += [f"- [`specdistill {c}`](#specdistill-{c.replace(' ', '-')})" for c, _, _ in found]
        for command, line, parser in found:
            lines += ["", f"## specdistill {command}", "", _cell(line), "", "```"]
            lines += [parser.format_usage().rstrip(), "```"]
            shown = examples(parser.description)
            if shown:
                lines += ["", "```bash", *"\n\n".join(shown).splitlines(), "```"]
            lines += ["", *options(parser)]
        return "\n".join(lines) + "\n"
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


if __name__ == "__main__":
    sys.stdout.write(render())
