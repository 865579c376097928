"""`specdistill <verb> ...`: one command line for the toolkit.

    specdistill distill --recipe recipes/code.yaml train.max_steps=50
    specdistill recipe show recipes/smollm2-eagle3.yaml   # each value and where it came from
    specdistill speculate --target embedded:code-deep --draft runs/code/final --prompts p --out o
    specdistill drift --draft D --target-before A --target-after B --prompts p.jsonl --out o \\
        --temperature 0,1 --fail-if-drop-above 0.02       # exit 1: the drop fails a deploy
    specdistill export --draft runs/code-eagle3/final --format vllm --out exported
    specdistill cache --recipe recipes/code.yaml --out runs/code-cache --top-n 64
    specdistill serve --target embedded:code-deep --draft runs/code/final --port 8000
    specdistill online --recipe recipes/online.yaml      # and: online rollback --drafts ROOT

Each verb is a module with a `main(argv)` and a `build_parser()` (`specdistill online`'s
subcommands: its `SUBVERBS`, and `SUBCOMMANDS` here for one that lives in a layer above the
verb's) that imports no model library, so `specdistill <verb> --help`
answers at once and docs/cli.md is generated from the parsers (specdistill/cli_docs.py).
The parsers come from specdistill/verb_parser.py: the usage line names the verb, examples
keep their line breaks, defaults are shown. The script paths (`train/distill.py`,
`eval/speculative.py`, `python -m specdistill.train.export`) call the same functions.
Anticipated errors (a bad recipe, malformed data, a missing file) print one line and exit 2;
`--debug` before the verb, or SPECDISTILL_DEBUG=1, shows the traceback instead.
"""

import difflib
import importlib
import os
import sys

from specdistill import threads
from specdistill.errors import one_line, run_guarded

# verb -> (module with main(argv) and build_parser(), one line for --help); the module must
# import nothing heavy at import time (tests/test_cli.py checks that torch stays unloaded)
VERBS = {
    "distill": ("specdistill.train.distill", "distil a draft to a frozen target from a recipe"),
    "recipe": (
        "specdistill.train.recipe_show",
        "`recipe show`: a recipe resolved, each value with the file:line, override or default "
        "that set it",
    ),
    "speculate": (
        "specdistill.eval.speculative",
        "run lossless speculative decoding; measure tau, speedup and the best gamma",
    ),
    "drift": (
        "specdistill.eval.drift_cli",
        "measure the draft's α drift after a target fine-tune; exit 1 when it fails a deploy",
    ),
    "export": ("specdistill.train.export_cli", "export a trained draft for vLLM, SGLang or HF"),
    "cache": (
        "specdistill.train.target_cache_cli",
        "cache the target's top-N log-probabilities over a recipe's data (target.cache)",
    ),
    "prepare": (
        "specdistill.train.prepare",
        "make a recipe's data once: the target resolved, its answers to the recipe's prompts",
    ),
    "regenerate": (
        "specdistill.train.regenerate",
        "answer a recipe's prompts with the target (resumable, deduplicated JSONL shards)",
    ),
    "online": (
        "specdistill.train.online.cli",
        "learn from served traffic: refresh, gate, publish drafts; `online rollback|demo`",
    ),
    "serve": (
        "specdistill.serve.serve_cli",
        "serve an OpenAI-compatible API with speculative decoding (hot-swapped drafts)",
    ),
    "convert-traffic": (
        "specdistill.serve.convert_cli",
        "turn vLLM responses or SGLang request dumps into the traffic log",
    ),
    "proxy": (
        "specdistill.serve.proxy_cli",
        "a logging proxy in front of vLLM's OpenAI server: its traffic for convert-traffic",
    ),
}


# (verb, subcommand) -> module with main(argv) and build_parser(): a subcommand that composes
# layers the verb's own module may not import (`online demo` runs a server beside the job)
SUBCOMMANDS = {("online", "demo"): "specdistill.online_demo.cli"}


def usage() -> str:
    width = max(map(len, VERBS))
    lines = [f"  {verb:<{width}}  {line}" for verb, (_, line) in VERBS.items()]
    return (
        "usage: specdistill [--debug] <verb> [args...]\n\nverbs:\n"
        + "\n".join(lines)
        + "\n\n`specdistill <verb> --help` describes a verb's arguments; docs/cli.md lists them"
        + " all."
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--debug":
        os.environ["SPECDISTILL_DEBUG"] = "1"
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        close = difflib.get_close_matches(verb, VERBS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        print(f"specdistill: unknown verb '{verb}'{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    try:  # before any verb imports torch: its OpenMP runtime reads the variable as it loads
        threads.check_environment()
    except threads.ThreadsError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    if rest and (verb, rest[0]) in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[verb, rest[0]])
        return run_guarded(module.main, rest[1:])
    module = importlib.import_module(VERBS[verb][0])
    return run_guarded(module.main, rest)


if __name__ == "__main__":
    sys.exit(main())
