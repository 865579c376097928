"""`specdistill serve`'s flags, generated from its options (serve/options.py `ServeOptions`).

One flag per field, in the fields' order: its name from the field's (`--max-num-seqs`, with
the aliases its `Cli` names), its type, default, choices and help from the field, and the
fields of one `Cli.one_of` group in a required either-or group. `parse_options` checks what
was parsed against the model: a value out of its bounds is a `UserError` naming the flag (one
line and exit 2 on the command line), before anything loads. `check_traffic_dir` is the one
check made on the disk (a server makes it before loading its models; the device:
eval/cli_args.py `resolve_device`).
"""

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from specdistill.errors import UserError
from specdistill.serve.options import ServeOptions, choices, cli_of, flag_name, value_type


def flag_arguments(name: str, field: FieldInfo) -> tuple[list[str], dict]:
    """`add_argument`'s names and keywords for the field `name`."""
    names = [flag_name(name), *cli_of(field).aliases]
    keywords: dict = {"dest": name, "help": field.description}
    kind = value_type(field)
    if kind is bool:
        keywords["action"] = "store_true"
        return names, keywords
    if field.is_required():
        keywords["required"] = True
    else:
        keywords["default"] = field.default
    if choices(field):
        keywords["choices"] = list(choices(field))
    elif kind in (int, float):
        keywords["type"] = kind
    return names, keywords


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel] = ServeOptions) -> None:
    """A flag on `parser` for every field of `model`."""
    groups: dict = {}  # group name -> its mutually exclusive group
    for name, field in model.model_fields.items():
        names, keywords = flag_arguments(name, field)
        group = cli_of(field).one_of
        if group is not None and group not in groups:
            groups[group] = parser.add_mutually_exclusive_group(required=True)
        (groups[group] if group is not None else parser).add_argument(*names, **keywords)


def parse_options(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> ServeOptions:
    """The command line's `ServeOptions`: what argparse cannot parse is its usage error; a
    value the model refuses, a `UserError` naming the flag."""
    return ServeOptions(**vars(parser.parse_args(argv)))


def check_traffic_dir(path: str | None) -> None:
    """--traffic names a directory, or a path one can be made at (its nearest existing
    ancestor a writable directory)."""
    if path is None:
        return
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise UserError(f"--traffic {path}: not a directory (the traffic log is a directory)")
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"--traffic {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--traffic {path}: {existing} is not writable")
