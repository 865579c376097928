"""The parsers of `specdistill online` and `online rollback`, built without importing the job
or the versions (which load torch), so that --help answers at once and docs/cli.md is
generated from them. Each command's module parses with its parser here; the descriptions are
those modules' docstrings. (`online demo`: specdistill/online_demo/cli.py.)"""

import argparse
from pathlib import Path

from specdistill.verb_parser import module_doc, verb_parser

HERE = Path(__file__).parent


def job_parser() -> argparse.ArgumentParser:
    """`specdistill online --recipe R [--follow | --once] [key.sub=value ...]` (job.py)."""
    p = verb_parser("online", module_doc(HERE / "job.py"))
    p.add_argument("--recipe", help="YAML recipe with an online: section")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--follow", action="store_true", help="tail new shards and lines")
    mode.add_argument("--once", action="store_true", help="one pass over the traffic, then exit")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    return p


def rollback_parser() -> argparse.ArgumentParser:
    """`specdistill online rollback [VERSION] --drafts ROOT` (dirs.py)."""
    p = verb_parser(
        "online rollback",
        "repoint ROOT/current (default: to its parent) after checking that the version "
        "loads; refused while an online job holds ROOT",
    )
    p.add_argument("version", nargs="?", help="vNNNNNN (default: the current one's parent)")
    p.add_argument("--drafts", required=True, help="the published root (ROOT)")
    return p
