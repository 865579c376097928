"""Prepare a recipe's data with one command: the target's own answers to its prompts.

    specdistill prepare --recipe recipes/smollm2-standalone.yaml
    specdistill distill --recipe recipes/smollm2-standalone.yaml

The recipe's `prepare` section names the prompts and where their answers go
(docs/recipe-keys.md):

    prepare:
      train: {prompts: [embedded:instructions], out: runs/smollm2-data, limit: 400}
      eval: {prompts: [embedded:instructions-heldout], out: runs/smollm2-heldout, limit: 48}
      max_new_tokens: 192
    data:
      train: [runs/smollm2-data/regen-*.jsonl]
      eval: [runs/smollm2-heldout/regen-*.jsonl]

The target is loaded once: a `registry:` model is fetched, checked and converted into the cache
on first use (models/registry.py). It answers through the project's engine, or through vLLM
with `prepare.engine: vllm` (`--engine vllm`; `auto`: vLLM where it is installed), in which case
the torch target loads only after vLLM has answered, for the target's outputs; an EAGLE-3
head's features then come from a vLLM prefill too (docs/real-model.md, "Answering with
vLLM"). Each set is then answered by `specdistill regenerate`'s
machinery (train/regenerate.py): the chat template, resumable shards, a manifest with the
target's identity and the sampling, a rerun that answers only what is missing. A set whose
directory already holds every answer costs nothing, so a rerun after an interruption, or with
another recipe that shares the data, resumes or does nothing.
"""

import json
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from specdistill import threads
from specdistill.errors import UserError, run_guarded
from specdistill.eval.cli_args import make_dir
from specdistill.models.target_spec import TargetSpec, load_tokenizer
from specdistill.publish import DirLock
from specdistill.train.regenerate import Sampling, regenerate
from specdistill.verb_parser import quiet_third_party, verb_parser


class PrepareError(UserError):
    """A recipe with nothing to prepare."""


@dataclass(frozen=True)
class PreparedSet:
    """What one set of prompts became."""

    name: str  # "train" or "eval"
    out: Path
    prompts: int
    answered: int
    tokens: int  # answer tokens in the directory's shards
    complete: bool


def answer_tokens(out: Path) -> int:
    """The answer tokens of a regenerate directory's shards (each record's count)."""
    total = 0
    for shard in sorted(out.glob("regen-*.jsonl")):
        for line in shard.read_bytes().splitlines():
            try:
                total += int(json.loads(line).get("completion_tokens", 0))
            except (ValueError, AttributeError, TypeError):
                continue  # a torn final line: regenerate cuts it off on its next run
    return total


def prepare(recipe, *, batch_size: int = 32, print=print) -> list[PreparedSet]:
    """Answer each set of `recipe.prepare` that has prompts; -> what each became."""
    p = recipe.prepare
    sets = [(name, s) for name in ("train", "eval") if (s := getattr(p, name)).prompts]
    if not sets:
        raise PrepareError(
            "the recipe has nothing to prepare: set prepare.train.prompts and prepare.train.out "
            "(and prepare.eval.*) to have the target answer them (docs/recipe-keys.md)"
        )
    sampling = Sampling(p.temperature, None, None, p.max_new_tokens, p.seed)
    t = recipe.target
    tokenizer = load_tokenizer(TargetSpec.from_recipe(t))
    from specdistill.train import answer_engine  # lazy: --help loads no torch

    start_threads = partial(threads.start, recipe.train.threads, name="train.threads")
    target, answerer, hidden = None, None, None  # vLLM answers from the model's files
    if answer_engine.resolve(p.engine) == answer_engine.PROJECT:
        print(f"prepare: loading the target {t.model}")
        target, _ = answer_engine.torch_target(recipe, tokenizer, start_threads)
    else:  # once for both sets, at its first answer: a start costs seconds, compiled minutes
        for _, s in sets:  # a directory another run writes into fails now, not after the start
            with DirLock(make_dir(s.out), "another prepare or regenerate"):
                pass
        print(f"prepare: answering with vLLM over {t.model}")
        answerer = answer_engine.vllm_engine(
            recipe, tokenizer, batch_size=batch_size, top_n=p.top_n
        )
        hidden = answer_engine.vllm_hidden_states(recipe, batch_size)
    try:
        engine = (target, tokenizer, answerer)
        done = [_answer(recipe, name, s, sampling, batch_size, engine, print) for name, s in sets]
    finally:
        if answerer is not None:
            answerer.close()
    if recipe.target.cache is not None and target is None:  # after vLLM has let go
        target, _ = answer_engine.torch_target(recipe, tokenizer, start_threads)
    teacher_outputs(recipe, target, tokenizer, print, hidden_states=hidden)
    return done


def _answer(recipe, name: str, s, sampling, batch_size: int, engine: tuple, print) -> PreparedSet:
    """Answer the set `name` (`s`, its prepare section) with `engine`: (the torch target or
    None, the tokenizer, a started `AnswerEngine` or None); -> what it became."""
    target, tokenizer, answerer = engine
    p = recipe.prepare
    started = time.monotonic()
    print(f"prepare: {name} answers of {', '.join(s.prompts)} -> {s.out}")
    data = recipe.data.model_copy(update={"train": list(s.prompts)})
    manifest = regenerate(
        recipe.model_copy(update={"data": data}),
        s.out,
        sampling=sampling,
        batch_size=batch_size,
        limit=s.limit,
        target=target,
        tokenizer=tokenizer,
        capture_top_n=p.top_n if name == "train" else None,
        answerer=answerer,
        print=print,
    )
    out = Path(s.out)
    result = PreparedSet(
        name,
        out,
        manifest["prompts"],
        manifest["answered"],
        answer_tokens(out),
        manifest["complete"],
    )
    captured = manifest.get("captured")
    kept = f", their top {p.top_n} kept ({captured['bytes'] / 2**20:,.1f} MiB)" if captured else ""
    print(
        f"prepare: {name}: {result.answered}/{result.prompts} prompts answered, "
        f"{result.tokens:,} answer tokens in {out}{kept} ({time.monotonic() - started:.0f} s)"
    )
    return result


def teacher_outputs(recipe, target, tokenizer, print=print, hidden_states=None) -> dict | None:
    """With `target.cache` set, what training reads from the target instead of running it:
    its log-probabilities over the recipe's training data, built once after the answers; a
    cache that already serves this data and this draft is kept. With `prepare.top_n`, its
    top N, read from what the answering kept (train/captured.py) with a forward only for
    the sequences that did not keep it; else a target pass (train/target_cache_build.py)
    over the draft's own columns for a draft over a reduced vocabulary or an EAGLE-3 head
    (with the hidden states the head reads: from vLLM's pass when `hidden_states` starts it,
    `target_cache_build.build_cache`), or its top-N. -> its manifest."""
    from specdistill import drafts  # lazy: --help loads no torch
    from specdistill.models import hub  # lazy: --help loads no torch
    from specdistill.train.captured import CapturedOutputs  # lazy: --help loads no torch
    from specdistill.train.config import recipe_datasets  # lazy: --help loads no pydantic

    # lazy: --help loads no torch
    from specdistill.train.target_cache import DEFAULT_TOP_N, CacheError, TargetCache
    from specdistill.train.target_cache_build import build_cache  # lazy: --help loads no torch
    from specdistill.train.target_cache_vocab import columns_for  # lazy: --help loads no torch

    r = recipe
    if r.target.cache is None:
        return None
    top_n = r.prepare.top_n
    columns = columns_for(drafts.planned(r.draft).capabilities, top_n)
    train_data, eval_data = recipe_datasets(r, tokenizer)
    vocab_size = hub.shared_vocab_size(target, None, tokenizer)
    path = Path(r.target.cache)
    if (path / "manifest.json").is_file():
        try:
            cache = TargetCache(path)
            cache.check(
                tokenizer=tokenizer,
                target_cfg=r.target,
                target=target,
                datasets={"train": train_data},
                vocab_size=vocab_size,
            )
            if cache.columns == columns and (top_n is None or cache.top_n == top_n):
                # the draft's columns and the hidden states it reads, as distill builds it
                _, kind = drafts.build(r.draft, target, tokenizer, train_data, print=_quiet)
                cache.bind(kind)
                print(f"prepare: the target's outputs in {path} serve this data: kept")
                return cache.manifest
        except CacheError as e:
            print(f"prepare: rebuilding {path}: {e}")
    started = time.monotonic()
    print(f"prepare: the target's outputs over the training data -> {path} ({columns})")
    captured = None
    if top_n is not None:
        captured = CapturedOutputs([Path(r.prepare.train.out)], top_n, vocab_size)
        for problem in captured.unreadable:
            print(f"prepare: not read, its answers take a target forward: {problem}")
    manifest = build_cache(
        r,
        path,
        top_n=top_n or DEFAULT_TOP_N,
        captured=captured,
        columns=columns,
        splits=("train",),
        target=target,
        tokenizer=tokenizer,
        train_data=train_data,
        eval_data=eval_data,
        overwrite=True,
        hidden_states=hidden_states,
        print=print,
    )
    print(
        f"prepare: {manifest['positions']:,} positions, {manifest['total_bytes'] / 2**20:,.0f} "
        f"MiB in {path} ({time.monotonic() - started:.0f} s)"
    )
    return manifest


def _quiet(*args) -> None:
    """A print that says nothing."""


def build_parser():
    parser = verb_parser("prepare", __doc__)
    parser.add_argument("--recipe", help="YAML recipe with a prepare section")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="answers decoded together (rows refilled as answers end)",
    )
    parser.add_argument(
        "--engine",
        choices=["specdistill", "vllm", "auto"],
        help="what answers (default: the recipe's prepare.engine; the same as prepare.engine=NAME)",
    )
    parser.add_argument("overrides", nargs="*", help="key.sub=value recipe overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_third_party()
    from specdistill.train.config import load_recipe  # lazy: --help loads no pydantic

    engine = [f"prepare.engine={args.engine}"] if args.engine else []
    recipe = load_recipe(args.recipe, [*args.overrides, *engine])
    results = prepare(
        recipe, batch_size=args.batch_size, print=lambda *a: print(*a, file=sys.stderr)
    )
    incomplete = [r.name for r in results if not r.complete]
    if incomplete:
        print(
            f"prepare: some {' and '.join(incomplete)} prompts failed every attempt "
            "(their failures.jsonl names them); rerun to retry them",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded(main, sys.argv[1:]))
