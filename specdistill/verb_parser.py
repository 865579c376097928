"""The argument parser every `specdistill <verb>` builds: one look for all verbs' --help.

`verb_parser("drift", __doc__)` gives an `argparse.ArgumentParser` whose usage line names the
verb (`usage: specdistill drift ...`, also when the module runs as a script), whose
description and epilog keep their line breaks (the examples), and whose options show their
defaults. A verb module builds its parser in a `build_parser()` that imports nothing heavy,
so `specdistill <verb> --help` and the generated reference (docs/cli.md) never load a model
library. Once the arguments are parsed, `quiet_third_party()` hides the model libraries'
per-run progress bars. Standard library only at import time.
"""

import argparse
import ast
import copy
import math
from pathlib import Path

__all__ = ["HelpFormatter", "module_doc", "quiet_third_party", "verb_parser"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs verbatim; `(default: X)` after an option's help when it has a
    default worth showing and its help does not already name it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" in text
            or default is argparse.SUPPRESS
            or default is None  # unset
            or default is False  # an off flag
            or (isinstance(default, list | tuple) and not default)
            or (not action.option_strings and action.nargs not in ("?", "*"))
        ):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, list | tuple) else default
        shown = str(shown).replace("%", "%%")
        return f"{text} (default: {shown})" if text else f"(default: {shown})"

    def _format_action(self, action: argparse.Action) -> str:
        # argparse skips the help string (and so the default) of an option without help
        if not action.help and (text := self._get_help_string(action)):
            action = copy.copy(action)
            action.help, action.default = text, argparse.SUPPRESS
        return super()._format_action(action)


def verb_parser(
    verb: str, description: str | None = None, epilog: str | None = None
) -> argparse.ArgumentParser:
    """An ArgumentParser for `specdistill <verb>` (a subverb: "online rollback")."""
    return argparse.ArgumentParser(
        prog=f"specdistill {verb}",
        description=description,
        epilog=epilog,
        formatter_class=HelpFormatter,
    )


def module_doc(path) -> str:
    """The docstring of the module at `path`, read without importing it (a parser built in a
    light module can describe a heavy one)."""
    return ast.get_docstring(ast.parse(Path(path).read_text(encoding="utf-8"))) or ""


def quiet_third_party() -> None:
    """Hide what the model libraries print on every run that a user cannot act on:
    transformers' "Loading weights" and "Writing model shards" bars (a local load or save
    takes seconds; the bar is one more line per model). Downloads keep their bars (a
    first run of a hub model can take minutes), unless HF_HUB_DISABLE_PROGRESS_BARS hides
    them as well. A verb calls this after parsing its arguments, so --help stays light."""
    try:
        # lazy: called once the arguments are parsed; --help loads no model library
        from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
        from transformers.utils import logging as hf_logging  # lazy: --help loads no torch
    except ImportError:  # the verb does not need them
        return
    downloads_hidden = are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # transformers' bars, and the hub's with them
    if not downloads_hidden:
        enable_progress_bars()  # the hub's download bars only


def temperatures(text: str) -> list[float]:
    """argparse type: comma-separated distinct finite numbers >= 0, at least one
    (sampling temperatures; 0 = greedy)."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v >= 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"needs at least one number >= 0, comma-separated; got {text!r}"
        )
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"a temperature is given twice in {text!r}")
    return values
