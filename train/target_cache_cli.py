"""`specdistill cache`: the frozen target's log-probabilities over a recipe's data, computed
once, so that training reads them instead of running the target: its top-N tokens, or
(`--columns draft`) every column of a draft over a reduced vocabulary.

    specdistill cache --recipe recipes/code.yaml --out runs/code-cache --top-n 64
    specdistill distill --recipe recipes/code.yaml target.cache=runs/code-cache
    specdistill cache --recipe recipes/smollm2-parallel.yaml --columns draft \\
        --out runs/smollm2-cache

The cache covers the very sequences the trainer batches (the recipe's tokenizer, data,
max_length, packing, eval split and seed) and is written beside --out, then renamed into
place. A run with `target.cache` compares the cache's manifest with its own tokenizer,
target and data before training. train/target_cache.py describes the format; docs/cache.md
gives the sizes.
"""

import argparse
import math
import sys

from specdistill import threads
from specdistill.errors import run_guarded
from specdistill.verb_parser import quiet_third_party, verb_parser

# train/target_cache.py's values (tests/test_cli.py checks that they agree): the parser is
# built without importing it, which loads torch
SPLITS = ("train", "eval")
VALUE_DTYPES = ("float16", "float32")
DEFAULT_TOP_N = 64
COLUMNS = ("top-n", "draft")  # train/target_cache_vocab.py's
DEFAULT_SHARD_MB = 256


def _megabytes(text: str) -> float:
    """argparse type: a finite number of MiB > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"needs a finite number > 0; got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = verb_parser("cache", __doc__)
    parser.add_argument("--recipe", help="YAML recipe (its target and data); defaults if omitted")
    parser.add_argument("--out", required=True, help="the cache directory to create")
    parser.add_argument("--top-n", type=int, default=DEFAULT_TOP_N, help="tokens kept per position")
    parser.add_argument(
        "--columns",
        choices=COLUMNS,
        default="top-n",
        help="top-n: the target's --top-n most probable tokens and the mass they leave (a "
        "standalone draft, over a reduced vocabulary too); draft: its log-probabilities over "
        "the draft's own columns (a draft with draft.vocab_size: exact, no target forward "
        "while training)",
    )
    parser.add_argument(
        "--values-dtype",
        choices=VALUE_DTYPES,
        default="float16",
        help="dtype of the stored log-probabilities and remaining mass",
    )
    parser.add_argument(
        "--splits", default=",".join(SPLITS), help="comma-separated splits to cache"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        help="sequences per forward (default: the recipe's train.micro_batch_size)",
    )
    parser.add_argument(
        "--shard-mb", type=_megabytes, default=DEFAULT_SHARD_MB, help="MiB per shard, > 0"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("overrides", nargs="*", help="key.sub=value recipe overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_third_party()
    from specdistill.train.config import load_recipe  # lazy: --help loads no pydantic
    from specdistill.train.target_cache import CacheError  # lazy: --help loads no torch
    from specdistill.train.target_cache_build import build_cache  # lazy: --help loads no torch

    recipe = load_recipe(args.recipe, args.overrides)
    splits = tuple(s.strip() for s in args.splits.split(",") if s.strip())
    unknown = [s for s in splits if s not in SPLITS]
    if unknown or not splits:
        raise CacheError(f"--splits takes {', '.join(SPLITS)}, got {args.splits!r}")
    threads.start(recipe.train.threads, name="train.threads")
    manifest = build_cache(
        recipe,
        args.out,
        top_n=args.top_n,
        columns=args.columns,
        values_dtype=args.values_dtype,
        splits=splits,
        batch_size=args.batch_size,
        shard_bytes=int(args.shard_mb * 2**20),
        overwrite=args.overwrite,
        print=lambda *a: print(*a, file=sys.stderr),
    )
    print(
        f"cache: {manifest['positions']} positions, "
        f"{'top-' if manifest['columns'] == 'top-n' else 'draft columns: '}{manifest['top_n']}, "
        f"{manifest['total_bytes'] / 2**20:.2f} MiB, {manifest['bytes_per_token']:.1f} bytes/token "
        f"in {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded(main, sys.argv[1:]))
