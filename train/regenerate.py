"""Regenerate a recipe's training answers with the target itself (self-distillation data).

    specdistill regenerate --recipe recipes/code.yaml --out runs/regen --temperature 0.7
    specdistill distill --recipe recipes/code.yaml 'data.train=runs/regen/regen-*.jsonl'

A draft learns best on text its target would write. This answers each prompt of the
recipe's `data.train` records with the target, through the project's engine
(`eval.engine.generate`, target alone, continuously batched), at the sampling parameters
given (recorded in the manifest):

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
repeated in the data are answered once. A rerun with another target or other sampling
parameters is refused (the shards would mix two distributions).

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
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdistill import threads
from specdistill.errors import run_guarded
from specdistill.eval.cli_args import make_dir
from specdistill.models.target_spec import TargetSpec, load_target_and_tokenizer
from specdistill.progress import WorkProgress
from specdistill.publish import DirLock, atomic_write_text
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
from specdistill.train.regenerate_sampling import (
    RegenerateError,
    Sampling,
)
from specdistill.train.regenerate_sampling import (
    check_sizes as _check_sizes,
)
from specdistill.verb_parser import quiet_third_party, verb_parser


@dataclass
class Job:
    """One prompt: `prompt` is the chat messages (a list) or the text prefix (a str)."""

    hash: str
    prompt: list | str
    origin: str


def prompt_hash(prompt: list | str) -> str:
    return hashlib.sha256(
        json.dumps(prompt, sort_keys=True, ensure_ascii=False).encode()
    ).hexdigest()


def jobs_from_records(records, tokenizer, text_prompt_tokens: int) -> tuple[list[Job], int]:
    """(one Job per distinct prompt, in data order; duplicates dropped)."""
    from specdistill.data.records import ChatRecord  # lazy: --help loads no torch

    jobs, seen, duplicates = [], set(), 0
    for record in records:
        if isinstance(record, ChatRecord):
            messages = record.messages
            last = max((i for i, m in enumerate(messages) if m["role"] != "assistant"), default=-1)
            if last < 0:
                continue  # nothing to answer
            prompt = [dict(m) for m in messages[: last + 1]]
        else:
            ids = tokenizer(record.text, add_special_tokens=False)["input_ids"]
            if len(ids) <= 1:
                continue
            prompt = tokenizer.decode(ids[:text_prompt_tokens])
        h = prompt_hash(prompt)
        if h in seen:
            duplicates += 1
            continue
        seen.add(h)
        jobs.append(Job(h, prompt, record.origin))
    return jobs, duplicates


def _record(job: Job, answer: str, n_tokens: int, token_ids: dict) -> dict:
    """The shard line of `job`'s answer; a chat answer carries the `token_ids` it was
    generated as (data/records.py)."""
    if isinstance(job.prompt, list):
        messages = [*job.prompt, {"role": "assistant", "content": answer}]
        body = {"messages": messages, "token_ids": token_ids}
    else:
        body = {"text": job.prompt + answer}
    return {**body, "prompt_hash": job.hash, "origin": job.origin, "completion_tokens": n_tokens}


def _encode(jobs: list[Job], tokenizer) -> list[list[int]]:
    from specdistill.eval.prompts import Prompt, encode_prompts  # lazy: --help loads no torch

    prompts = [
        Prompt(j.hash, messages=j.prompt)
        if isinstance(j.prompt, list)
        else Prompt(j.hash, text=j.prompt)
        for j in jobs
    ]
    return encode_prompts(prompts, tokenizer)


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
    print=print,
) -> dict:
    """Answer the recipe's prompts not yet answered in `out`; return the manifest.
    `generate` defaults to `eval.engine.generate` (tests pass a wrapper). `capture_top_n`:
    also keep the target's top N at every answer token, from the forwards that chose them
    (OUT/captured/, train/captured.py), its log-probabilities in `capture_dtype`."""
    from specdistill.eval import engine  # lazy: --help loads no torch

    sampling = (sampling or Sampling()).check()
    _check_sizes(
        batch_size=batch_size,
        shard_records=shard_records,
        retries=retries,
        text_prompt_tokens=text_prompt_tokens,
        limit=limit,
    )
    generate = generate or engine.generate
    r = recipe
    out = make_dir(out)
    with DirLock(out, "another prepare or regenerate"), writable(out):  # one writer
        sizes = (batch_size, shard_records, retries, text_prompt_tokens, limit)
        capture = (capture_top_n, capture_dtype)
        return _regenerate_into(
            r, out, sampling, sizes, target, tokenizer, generate, capture, print
        )


def _regenerate_into(
    r,
    out: Path,
    sampling: Sampling,
    sizes: tuple[int, int, int, int, int | None],
    target,
    tokenizer,
    generate: Callable,
    capture: tuple[int | None, str],
    print: Callable,
) -> dict:
    """`regenerate`'s work once OUT is locked: load, read, answer, write the manifest.
    `sizes`: (batch_size, shard_records, retries, text_prompt_tokens, limit), checked;
    `capture`: (top N kept at each answer token or None, their dtype)."""
    batch_size, shard_records, retries, text_prompt_tokens, limit = sizes
    from specdistill.data.sources import read_records  # lazy: --help loads no torch
    from specdistill.train.captured import capture_writer  # lazy: --help loads no torch

    # lazy: --help loads no torch
    from specdistill.train.target_cache import VALUE_DTYPES, target_identity

    target, tokenizer = _load_target(r, target, tokenizer)
    identity = target_identity(r.target, target)
    previous = _previous_manifest(out, identity, sampling)
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
        "engine": "specdistill.eval.engine.generate (target only)",
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
    answering = _Answering(
        target=target,
        tokenizer=tokenizer,
        generate=generate,
        sampling=sampling,
        batch_size=batch_size,
        retries=retries,
        writer=ShardWriter(out, shard_records),
        failures_path=out / FAILURES,
        failed=failed,
        print=print,
        capture=capture_writer(out, capture[0], target, tokenizer, VALUE_DTYPES[capture[1]]),
    )
    _answer_all(answering, todo, f"regenerate {out.name}")
    return _finish(out, manifest, jobs, answering, print)


def _load_target(r, target, tokenizer) -> tuple:
    """(target, tokenizer): the recipe's, each loaded unless given (models/target_spec.py); a
    loaded target starts the recipe's threads and moves to the GPU when there is one."""
    given = target is not None
    target, tokenizer = load_target_and_tokenizer(
        TargetSpec.from_recipe(r.target), target=target, tokenizer=tokenizer
    )
    if not given:
        threads.start(r.train.threads, name="train.threads")  # on stderr, once it loads
        if hasattr(target, "to"):
            import torch  # lazy: --help loads no torch

            target = target.to("cuda" if torch.cuda.is_available() else "cpu")
    return target, tokenizer


def _previous_manifest(out: Path, identity: dict, sampling: Sampling) -> dict | None:
    """OUT's manifest from an earlier run (None on a first run); RegenerateError when it was
    written for another target or other sampling parameters."""
    previous = read_manifest(out)
    if previous is None:
        return None
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


@dataclass
class _Answering:
    """One run's answering: the target and its sampling, the shard the answers go to, and the
    failures (`failed`: prompt hash -> its failure over all runs; `failures`: this run's)."""

    target: object
    tokenizer: object
    generate: Callable
    sampling: Sampling
    batch_size: int
    retries: int
    writer: ShardWriter
    failures_path: Path
    failed: dict[str, dict]
    print: Callable
    capture: object | None = None  # a train.captured.CaptureWriter: the top N kept too
    failures: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        tokenizer = self.tokenizer
        self.eos = tokenizer.eos_token_id
        self.im_end = (
            tokenizer.convert_tokens_to_ids("<|im_end|>")
            if "<|im_end|>" in tokenizer.get_vocab()
            else None
        )

    def run(self, batch: list[Job], seed: int) -> list[tuple]:
        """Each job's (prompt ids, generated ids, captured entries or None)."""
        sampling = self.sampling
        prompts = _encode(batch, self.tokenizer)
        capture, extra, longer = self.capture, {}, 0
        if capture is not None:  # one token more: the distribution after a cut answer's last
            extra, longer = {"logprobs": capture.top_n, "vocab_size": capture.vocab_size}, 1
        gen = self.generate(
            self.target,
            None,
            prompts,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_new_tokens=sampling.max_new_tokens + longer,
            seed=seed,
            batch_size=self.batch_size,
            eos_token_id=self.eos,
            **extra,
        )
        entries = gen.logprobs or [None] * len(prompts)
        return list(zip(prompts, gen.sequences, entries, strict=True))

    def write(self, job: Job, answer: tuple) -> None:
        """Append `job`'s answer (a `run` result); its captured entries go to the capture."""
        prompt, ids, entries = answer
        if self.capture is not None:
            self.capture.add(prompt, ids, entries)
        drawn = list(ids)  # a cut answer's next token too, where the capture asked for it
        stop = [t for t in (self.eos, self.im_end) if t is not None]
        for t in stop:  # the answer ends before the end-of-turn / end-of-text token
            if t in ids:
                drawn = drawn[: drawn.index(t) + 1]
                ids = ids[: ids.index(t)]
        ids = ids[: self.sampling.max_new_tokens]
        answer = self.tokenizer.decode(ids, skip_special_tokens=True)
        token_ids = {"prompt": list(prompt), "answer": drawn}
        self.writer.append(_record(job, answer, len(ids), token_ids))

    def answer(self, batch: list[Job]) -> None:
        """Answer `batch` together; when that fails, each prompt on its own, with retries."""
        seed = self.sampling.seed + int(batch[0].hash[:8], 16)
        try:
            sequences = self.run(batch, seed)
        except Exception as e:  # the batch failed: each prompt on its own, with retries
            self.print(f"regenerate: a batch failed ({type(e).__name__}: {e}); retrying singly")
        else:  # a failed write (a full disk) is no failed answer: it stops the run
            for job, answer in zip(batch, sequences, strict=True):
                self.write(job, answer)
            return
        for job in batch:
            error = self.answer_alone(job)
            if error is not None:
                self.record_failure(job, error)

    def answer_alone(self, job: Job) -> str | None:
        """None once `job` is answered, else the last of its `retries + 1` attempts' error."""
        error = None
        for attempt in range(1, self.retries + 2):
            try:
                (answer,) = self.run([job], self.sampling.seed + int(job.hash[:8], 16) + attempt)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                continue
            self.write(job, answer)
            return None
        return error

    def record_failure(self, job: Job, error: str) -> None:
        """Count `job`'s failed attempts and runs on top of earlier runs'; rewrite the file."""
        before = self.failed.get(job.hash, {})
        failure = {
            "prompt_hash": job.hash,
            "origin": job.origin,
            "error": error,
            "attempts": before.get("attempts", 0) + self.retries + 1,
            "runs": before.get("runs", 0) + 1,
            "time": time.time(),
        }
        self.failures.append(failure)
        self.failed[job.hash] = failure
        write_failures(self.failures_path, self.failed)


# Prompts handed to the engine at once, in batches: the engine keeps `batch_size` rows
# decoding and refills a row as soon as its answer ends, so a chunk of several batches does
# not wait for each batch's longest answer (benchmarks/prepare_rate.py). A chunk's answers
# are written when it ends: a killed run redoes at most one chunk.
CHUNK_BATCHES = 4


def _answer_all(answering: _Answering, todo: list[Job], name: str) -> None:
    """Answer `todo` chunk by chunk, with a progress line; the shard is closed after."""
    chunk = answering.batch_size * CHUNK_BATCHES
    progress = WorkProgress(name, len(todo)) if todo else None
    try:
        for start in range(0, len(todo), chunk):
            batch = todo[start : start + chunk]
            if progress is not None and start:  # the chunk before this one is done
                progress.advance(chunk, f"{start}/{len(todo)} prompts")
            answering.answer(batch)
            if answering.capture is not None:  # the chunk's kept outputs, as one part
                answering.capture.flush()
        if progress is not None:
            progress.advance(len(todo) - progress.done, f"{len(todo)}/{len(todo)} prompts")
    finally:
        answering.writer.close()
        if progress is not None:
            progress.close()


def _finish(out: Path, manifest: dict, jobs: list[Job], answering: _Answering, print) -> dict:
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
        print=lambda *a: print(*a, file=sys.stderr),
    )
    return 1 if manifest["failed_this_run"] else 0


if __name__ == "__main__":
    sys.exit(run_guarded(main, sys.argv[1:]))
