"""Regenerate a recipe's training answers with the target itself (self-distillation data).

    specdistill regenerate --recipe recipes/code.yaml --out runs/regen --temperature 0.7
    specdistill distill --recipe recipes/code.yaml 'data.train=runs/regen/regen-*.jsonl'

A draft learns best on text its target would write. This answers each prompt of the
recipe's `data.train` records with the target, through the project's engine
(`eval.engine.generate`, target alone, continuously batched) or, with `--engine vllm` (or the
recipe's `prepare.engine: vllm`), through vLLM's offline engine over the same model files
(eval/vllm_engine.py; the recipe's `prepare.vllm` settings), at the sampling parameters given
(recorded in the manifest):

- a chat record's prompt is its messages up to the last non-assistant one; the answer
  replaces what followed: {"messages": [...prompt, {"role": "assistant", "content": answer}]};
- a text record's prompt is its first `--text-prompt-tokens` tokens; the record becomes
  {"text": prompt + answer}.

Output, usable as `data.train` (the glob OUT/regen-*.jsonl; not OUT itself, whose manifest
and failures file are not records):

    OUT/manifest.json             target identity, sampling, sources, counts
    OUT/regen-000001.jsonl, ...   one record per line, each with its `prompt_hash`
    OUT/failures.jsonl            prompts that failed every attempt and are still
                                  unanswered: one line per prompt hash (latest error,
                                  attempts over all runs, runs)

Each record is one `os.write` of a whole line, then fsync (as serve/traffic.py's log), and
every run opens a new shard, so a kill leaves at most a torn final line, which the next run
cuts off before writing (and `answered` skips).
A rerun resumes: prompts whose hash is already in a shard are not answered again; prompts
repeated in the data are answered once. A rerun with another target, other sampling
parameters, another engine or another answering dtype is refused (the shards would mix two
distributions).

The sampling parameters and sizes are checked before anything is loaded or written
(temperature finite and >= 0, top_p in (0, 1], top_k, max_new_tokens, batch and shard sizes
>= 1, retries >= 0, seed in [0, 2**63 - 1]), and OUT must be a directory or creatable. One
run writes into OUT at a time (`flock` on OUT/.lock): a second regenerate or prepare on the
same OUT fails at once naming the holder's pid, so no prompt is answered twice. A
malformed data record (one holding a lone surrogate, "\\ud800" without its pair, too) is
skipped, named (`file:line` and the problem) and counted by reason as distill's data reader
counts it (`DataError.reason`); the counts go into the manifest's `skipped`. The exit status
is 1 when a prompt failed every attempt in this run (it is in OUT/failures.jsonl; a rerun
tries it again), else 0.
"""

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path

from specdistill import threads
from specdistill.errors import run_guarded
from specdistill.eval.cli_args import make_dir
from specdistill.publish import DirLock, atomic_write_text
from specdistill.train.regenerate_answering import Answering, answer_all
from specdistill.train.regenerate_output import (
    FAILURES,
    MANIFEST,
    ShardWriter,
    answered,
    no_prompts,
    read_failures,
    read_manifest,
    valid_records,
    writable,
    write_failures,
)
from specdistill.train.regenerate_prompts import Job, jobs_from_records
from specdistill.train.regenerate_sampling import (
    RegenerateError,
    Sampling,
)
from specdistill.train.regenerate_sampling import (
    check_sizes as _check_sizes,
)
from specdistill.verb_parser import quiet_third_party, verb_parser


def regenerate(
    recipe,
    out: str | os.PathLike,
    *,
    sampling: Sampling | None = None,
    batch_size: int = 32,
    shard_records: int = 1000,
    retries: int = 2,
    text_prompt_tokens: int = 64,
    limit: int | None = None,
    target=None,
    tokenizer=None,
    generate=None,
    capture_top_n: int | None = None,
    capture_dtype: str = "float16",
    engine: str = "specdistill",
    answerer=None,
    print=print,
) -> dict:
    """Answer the recipe's prompts not yet answered in `out`; return the manifest.
    `engine`: "specdistill" (the project's engine: `generate`, default `eval.engine.generate`;
    tests pass a wrapper) or "vllm" (vLLM over the target's files, `recipe.prepare.vllm`'s
    settings; train/answer_engine.py). `capture_top_n`: also keep the target's top N at
    every answer token, from the forwards that chose them (OUT/captured/,
    train/captured.py), its log-probabilities in `capture_dtype`. `answerer`: an engine the
    caller built (train/answer_engine.py; a benchmark that times its start apart) and closes,
    in place of `engine`'s."""
    sampling = (sampling or Sampling()).check()
    _check_sizes(
        batch_size=batch_size,
        shard_records=shard_records,
        retries=retries,
        text_prompt_tokens=text_prompt_tokens,
        limit=limit,
    )
    from specdistill.train import answer_engine  # lazy: --help loads no torch

    r = recipe
    out = make_dir(out)
    with DirLock(out, "another prepare or regenerate"), writable(out):  # one writer
        own = answerer is None
        if own:
            threads_start = partial(threads.start, r.train.threads, name="train.threads")
            answerer = answer_engine.build(
                r,
                engine,
                target=target,
                tokenizer=tokenizer,
                generate=generate,
                start_threads=threads_start,
                batch_size=batch_size,
                top_n=capture_top_n,
            )
        try:
            sizes = (batch_size, shard_records, retries, text_prompt_tokens, limit)
            capture = (capture_top_n, capture_dtype)
            return _regenerate_into(r, out, sampling, sizes, answerer, capture, print)
        finally:
            if own:
                answerer.close()


def _regenerate_into(
    r,
    out: Path,
    sampling: Sampling,
    sizes: tuple[int, int, int, int, int | None],
    answerer,
    capture: tuple[int | None, str],
    print: Callable,
) -> dict:
    """`regenerate`'s work once OUT is locked: read, answer (`answerer`, a
    `train.answer_engine.AnswerEngine`), write the manifest.
    `sizes`: (batch_size, shard_records, retries, text_prompt_tokens, limit), checked;
    `capture`: (top N kept at each answer token or None, their dtype)."""
    batch_size, shard_records, retries, text_prompt_tokens, limit = sizes
    from specdistill.data.sources import read_records  # lazy: --help loads no torch
    from specdistill.train.captured import CaptureWriter  # lazy: --help loads no torch
    from specdistill.train.target_cache import VALUE_DTYPES  # lazy: --help loads no torch

    tokenizer, identity = answerer.tokenizer, answerer.identity
    previous = _previous_manifest(out, identity, sampling, answerer.answered_in)
    records, skipped = valid_records(read_records(list(r.data.train)), print)
    jobs, duplicates = jobs_from_records(records, tokenizer, text_prompt_tokens)
    if not jobs:  # before anything is written: an empty or unreadable prompts file
        no_prompts(r.data.train, skipped)
    if limit:
        jobs = jobs[:limit]
    done, failed = answered(out), read_failures(out / FAILURES)  # before anything is written
    todo = [j for j in jobs if j.hash not in done]
    manifest = {
        "format": "specdistill-regenerated",
        "target": identity,
        "sampling": asdict(sampling),
        "engine": answerer.description,
        "answered_in": answerer.answered_in,
        "sources": list(r.data.train),
        "text_prompt_tokens": text_prompt_tokens,
        "prompts": len(jobs),
        "duplicates_dropped": duplicates,
        "skipped": skipped,
        "started": (previous or {}).get("started")
        or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    atomic_write_text(out / MANIFEST, json.dumps({**manifest, "complete": False}, indent=1))
    print(f"regenerate: {len(jobs)} prompts, {len(jobs) - len(todo)} already answered")
    top_n, dtype = capture
    answering = Answering(
        target=answerer.model,
        tokenizer=tokenizer,
        generate=answerer.generate,
        sampling=sampling,
        batch_size=answerer.concurrency or batch_size,  # vLLM: its max_num_seqs
        retries=retries,
        writer=ShardWriter(out, shard_records),
        failures_path=out / FAILURES,
        failed=failed,
        print=print,
        capture=None
        if top_n is None
        else CaptureWriter(out, top_n, answerer.vocab_size, VALUE_DTYPES[dtype]),
    )
    answer_all(answering, todo, f"regenerate {out.name}")
    return _finish(out, manifest, jobs, answering, print)


def _previous_manifest(
    out: Path, identity: dict, sampling: Sampling, answered_in: dict
) -> dict | None:
    """OUT's manifest from an earlier run (None on a first run); RegenerateError when it was
    written for another target, other sampling parameters, or answered by another engine or
    in another dtype (a manifest without `answered_in`: the project's engine, in the
    target's dtype)."""
    previous = read_manifest(out)
    if previous is None:
        return None
    before = previous.get("answered_in") or {
        "engine": "specdistill",  # written before vLLM could answer
        "dtype": previous["target"].get("dtype"),
    }
    if before != answered_in:
        raise RegenerateError(
            f"{out} holds answers by {before['engine']} in {before['dtype']}, this run answers "
            f"with {answered_in['engine']} in {answered_in['dtype']}: the shards would mix two "
            "distributions; use the same engine and dtype or another --out"
        )
    if previous["target"]["identity"] != identity["identity"]:
        raise RegenerateError(
            f"{out} holds answers of another target ({previous['target'].get('model')}, "
            f"{previous['target']['identity'][:19]}…); use another --out"
        )
    if previous["sampling"] != asdict(sampling):
        raise RegenerateError(
            f"{out} was generated with sampling {previous['sampling']}, this run asks for "
            f"{asdict(sampling)}; use the same parameters or another --out"
        )
    return previous


def _finish(out: Path, manifest: dict, jobs: list[Job], answering: Answering, print) -> dict:
    """Drop the failures answered since from the failures file; complete the manifest."""
    done = answered(out)
    failed, failures = answering.failed, answering.failures
    if any(h in done for h in failed):  # answered since: no longer a failure
        write_failures(out / FAILURES, {h: f for h, f in failed.items() if h not in done})
    manifest.update(
        answered=sum(j.hash in done for j in jobs),
        failed_this_run=len(failures),
        complete=all(j.hash in done for j in jobs),
        finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    capture = answering.capture
    if capture is not None:  # what the answers' captured top N take on disk
        manifest["captured"] = {"top_n": capture.top_n, "bytes": capture.bytes_written}
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1))
    print(f"regenerate: {manifest['answered']}/{len(jobs)} answered, {len(failures)} failed")
    return manifest


def build_parser() -> argparse.ArgumentParser:
    parser = verb_parser("regenerate", __doc__)
    parser.add_argument("--recipe", help="YAML recipe (its target and data.train)")
    parser.add_argument("--out", required=True, help="output directory (a rerun resumes it)")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    parser.add_argument("--top-p", type=float, help="in (0, 1]; off when unset")
    parser.add_argument("--top-k", type=int, help=">= 1; off when unset")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="answers decoded together (rows refilled as answers end)",
    )
    parser.add_argument("--shard-records", type=int, default=1000, help="records per shard")
    parser.add_argument(
        "--retries", type=int, default=2, help="extra attempts of a prompt whose batch failed"
    )
    parser.add_argument(
        "--text-prompt-tokens", type=int, default=64, help="a text record's prompt: its first N"
    )
    parser.add_argument("--limit", type=int, help="answer the first N distinct prompts only")
    parser.add_argument(
        "--engine",
        choices=["specdistill", "vllm", "auto"],
        help="what answers (default: the recipe's prepare.engine); vllm takes the recipe's "
        "prepare.vllm settings",
    )
    parser.add_argument("overrides", nargs="*", help="key.sub=value recipe overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`specdistill regenerate`: 1 when a prompt failed (OUT/failures.jsonl), else 0."""
    args = build_parser().parse_args(argv)
    quiet_third_party()
    from specdistill.train.config import load_recipe  # lazy: --help loads no pydantic

    recipe = load_recipe(args.recipe, args.overrides)
    sampling = Sampling(args.temperature, args.top_p, args.top_k, args.max_new_tokens, args.seed)
    manifest = regenerate(
        recipe,
        args.out,
        sampling=sampling,
        batch_size=args.batch_size,
        shard_records=args.shard_records,
        retries=args.retries,
        text_prompt_tokens=args.text_prompt_tokens,
        limit=args.limit,
        engine=args.engine or recipe.prepare.engine,
        print=lambda *a: print(*a, file=sys.stderr),
    )
    return 1 if manifest["failed_this_run"] else 0


if __name__ == "__main__":
    sys.exit(run_guarded(main, sys.argv[1:]))
