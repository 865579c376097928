"""`specdistill convert-traffic`: its parser and command line, apart from serve/convert.py
(whose docstring is the description) so that --help imports neither pydantic's traffic schema
nor a model library."""

import argparse
import sys
from pathlib import Path

from specdistill.errors import run_guarded
from specdistill.models.target_spec import TargetSpec, load_tokenizer
from specdistill.verb_parser import module_doc, quiet_third_party, verb_parser

# serve/convert.py's SOURCES (tests/test_cli.py checks that they agree)
SOURCES = ("vllm", "sglang")


def build_parser() -> argparse.ArgumentParser:
    parser = verb_parser("convert-traffic", module_doc(Path(__file__).with_name("convert.py")))
    parser.add_argument(
        "--from", dest="source", required=True, choices=SOURCES, help="the engine that served"
    )
    parser.add_argument("--input", required=True, help="a file, or a directory of files")
    parser.add_argument("--target", required=True, help="the model the engine served")
    parser.add_argument("--out", required=True, help="traffic directory to append to")
    parser.add_argument(
        "--target-adapter",
        default=None,
        help="the peft LoRA adapter the engine served on --target (its files enter the "
        "identity, as with `specdistill serve --target-adapter`)",
    )
    parser.add_argument(
        "--target-identity",
        default=None,
        help="the identity the online job expects (a record's target.identity from "
        "`specdistill serve`); default: computed from --target as the server does, which "
        "matches for a local model directory",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # lazy: --help loads no torch
    from specdistill.serve.convert import check_out, convert, input_files

    inputs = input_files(Path(args.input))
    check_out(Path(args.out))  # before the tokenizer loads
    quiet_third_party()
    from specdistill.models.identity import model_identity  # lazy: --help loads no torch

    tokenizer = load_tokenizer(TargetSpec(model=args.target, adapter=args.target_adapter))
    identity = args.target_identity or model_identity(args.target, adapter=args.target_adapter)
    name = f"{args.target}+{args.target_adapter}" if args.target_adapter else args.target
    target = {"name": name, "identity": identity}
    result = convert(args.source, inputs, tokenizer, target, Path(args.out))
    reasons = ", ".join(f"{k}: {v}" for k, v in result["rejected"].items()) or "none"
    print(
        f"converted {result['converted']} records into {args.out} "
        f"({result['already_logged']} already there); rejected: {reasons}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded(main, sys.argv[1:]))
