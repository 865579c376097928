"""`specdistill export`: a trained draft (EAGLE-3 head or standalone causal LM) for vLLM,
SGLang or the Hugging Face Hub layout.

    specdistill export --draft runs/code/final --format vllm --out exports/code-vllm
    specdistill export --draft runs/eagle/final --format sglang --out exports/eagle-sgl \\
        --verifier Qwen/Qwen2.5-Coder-7B-Instruct --speculative-tokens 3
    specdistill export --draft my-draft --format vllm --out exports/d --tokenizer TARGET_DIR

The draft is checked before anything is written (readable weights that cover its config, a
head's vocabulary map, what the format can hold, the tokenizer files); the export is written
beside --out, re-read, checked and renamed into place, and the command prints how the engine
serves it. train/export/__init__.py describes each format.
"""

import argparse
import sys
from pathlib import Path

from specdistill.errors import run_guarded
from specdistill.verb_parser import quiet_third_party, verb_parser

# train/export's formats (tests/test_cli.py checks that they agree): the parser is built
# without importing the exporters, which load torch
FORMATS = ("vllm", "sglang", "hf")


def build_parser() -> argparse.ArgumentParser:
    parser = verb_parser("export", __doc__)
    parser.add_argument("--draft", required=True, help="trained draft directory")
    parser.add_argument(
        "--format", required=True, choices=FORMATS, dest="fmt", help="the inference engine"
    )
    parser.add_argument("--out", required=True, help="output directory (must be empty)")
    parser.add_argument(
        "--verifier",
        default=None,
        help="target model id or path written into a speculators config "
        "(default: the training recipe's target, else the draft config's verifier)",
    )
    parser.add_argument(
        "--speculative-tokens",
        type=int,
        default=None,
        metavar="N",
        help="speculative tokens per step written into the export (default: the head's "
        "training depth, else the training recipe's draft.ttt_steps, else 3)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="directory whose tokenizer files the export carries, e.g. the target's "
        "(default: --draft's; a standalone draft without them is refused)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_third_party()
    # lazy: --help loads no torch
    from specdistill.train.export import Options, export_with_plan, serve_hint

    tokenizer = Path(args.tokenizer) if args.tokenizer else None
    options = Options(Path(args.draft), args.verifier, args.speculative_tokens, tokenizer)
    try:
        out, kind, plan = export_with_plan(args.draft, args.fmt, args.out, options, args.overwrite)
    # ExportError, VocabMapError, IncompleteDraftError, BrokenWeightsError, unreadable drafts
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.fmt} export of the {kind.name} draft to {out}")
    print("serve with: " + serve_hint(args.fmt, kind, out, plan))
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded(main, sys.argv[1:]))
