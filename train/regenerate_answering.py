"""`regenerate`'s answering: prompts handed to an engine chunk by chunk, each answer written
as it comes back, a failed batch retried prompt by prompt, the failures counted over runs.

A chunk holds `CHUNK_BATCHES` batches of prompts: the engine keeps `batch_size` rows decoding
and refills a row as soon as its answer ends, so a chunk of several batches does not wait for
each batch's longest answer (benchmarks/prepare_rate.py). A chunk's answers are written when
it ends: a killed run redoes at most one chunk.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specdistill.progress import WorkProgress
from specdistill.train.regenerate_output import ShardWriter, write_failures
from specdistill.train.regenerate_prompts import Job, encode, record
from specdistill.train.regenerate_sampling import Sampling


@dataclass
class Answering:
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
        prompts = encode(batch, self.tokenizer)
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
        self.writer.append(record(job, answer, len(ids), token_ids))

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


CHUNK_BATCHES = 4  # batches of prompts handed to the engine at once (the docstring)


def answer_all(answering: Answering, todo: list[Job], name: str) -> None:
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
