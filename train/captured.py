"""The target's outputs captured while it answers (`prepare.top_n`), so that the target cache
needs no second pass of the target over its own answers.

Each forward that chooses an answer token also gives the target's distribution at that
position; `regenerate` keeps its top N (log-softmax at temperature 1 over the compared
columns, the rest mass beside them) with the prompt's and the answer's token ids:

    OUT/captured/part-000001.safetensors   one file per chunk of answers, written whole
        prompt_ids [P] int32, prompt_offsets [R + 1] int64      the prompts as encoded
        completion_ids [T] int32, completion_offsets [R + 1]    the tokens generated
        indices [T, N] int32, logprobs [T, N] float16, rest [T] float16 (float32 on request)
        metadata: top_n, vocab_size

The distribution at answer step j is the target's given the prompt and the first j generated
tokens, whatever token was then drawn. An answer cut at max_new_tokens is generated one token
longer than it is written, so that the distribution after its last token (where the chat
template adds its end token) is captured too. `CapturedOutputs` serves the rows of a training
sequence from them when the sequence conditions them as they were generated: its prefix
before the first trained token is a captured prompt, token for token, and the tokens after it
up to its last trained position are the generated ones. A sequence whose text tokenizes
otherwise (a non-canonical split the sampler chose) is not served, and the cache builds its
rows with a target forward (train/target_cache_build.py). A part is written atomically after
its answers, so a killed run loses at most the last chunk's capture, which those sequences
then get from the forward.
"""

import hashlib
import os
import re
from itertools import chain
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdistill.models import hub
from specdistill.train.target_cache_shards import rest_mass

CAPTURED = "captured"
PART = re.compile(r"part-(\d{6})\.safetensors$")


def _prompt_key(ids) -> str:
    return hashlib.sha256(torch.as_tensor(ids, dtype=torch.int32).numpy().tobytes()).hexdigest()


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)


class CaptureWriter:
    """Collects one chunk's answers with their top-N (`add`), then writes them as one part
    (`flush`)."""

    def __init__(self, out: Path, top_n: int, vocab_size: int, dtype=torch.float16):
        self.dir = Path(out) / CAPTURED
        self.dir.mkdir(parents=True, exist_ok=True)
        self.top_n, self.vocab_size, self.dtype = top_n, vocab_size, dtype
        existing = [int(m[1]) for p in self.dir.iterdir() if (m := PART.match(p.name))]
        self.index = max(existing, default=0)
        self.bytes_written = sum(p.stat().st_size for p in self.dir.glob("part-*.safetensors"))
        self._reset()

    def _reset(self) -> None:
        self.prompts, self.completions, self.rows = [], [], []

    def add(self, prompt_ids: list[int], completion_ids: list[int], entries: list) -> None:
        """One answer: its prompt's ids, the generated ids (the stop token included), and the
        engine's entries per generated token (`eval.engine.Generation.logprobs`)."""
        if len(entries) != len(completion_ids):
            raise ValueError(
                f"{len(entries)} captured distributions for {len(completion_ids)} tokens"
            )
        if not entries:
            return
        n = self.top_n
        indices = torch.tensor([[t for t, _ in alts[:n]] for _, alts in entries], dtype=torch.int32)
        values = torch.tensor([[v for _, v in alts[:n]] for _, alts in entries])
        if indices.shape[1] != n:
            raise ValueError(f"captured {indices.shape[1]} alternatives, expected {n}")
        rest = rest_mass(values)
        self.prompts.append(list(prompt_ids))
        self.completions.append(list(completion_ids))
        self.rows.append((indices, values, rest))

    def flush(self) -> None:
        """Write the collected answers as the next part (atomically); nothing when none."""
        if not self.rows:
            return
        tensors = {
            "prompt_ids": torch.tensor(list(chain(*self.prompts)), dtype=torch.int32),
            "prompt_offsets": _offsets([len(p) for p in self.prompts]),
            "completion_ids": torch.tensor(list(chain(*self.completions)), dtype=torch.int32),
            "completion_offsets": _offsets([len(c) for c in self.completions]),
            "indices": torch.cat([r[0] for r in self.rows]),
            "logprobs": torch.cat([r[1] for r in self.rows]).to(self.dtype),
            "rest": torch.cat([r[2] for r in self.rows]).to(self.dtype),
        }
        self.index += 1
        path = self.dir / f"part-{self.index:06d}.safetensors"
        tmp = path.with_name(f".tmp-{path.name}")
        metadata = {"top_n": str(self.top_n), "vocab_size": str(self.vocab_size)}
        save_file(tensors, str(tmp), metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.bytes_written += path.stat().st_size
        self._reset()


def capture_writer(out: Path, top_n: int | None, target, tokenizer, dtype=torch.float16):
    """The writer of a regenerate run's captured top N (None without), over the columns the
    target cache compares (`hub.shared_vocab_size`)."""
    if top_n is None:
        return None
    return CaptureWriter(out, top_n, hub.shared_vocab_size(target, None, tokenizer), dtype)


class CapturedOutputs:
    """The captured parts under one or more answer directories, looked up by the prompt's
    token ids."""

    def __init__(self, outs: list[Path], top_n: int, vocab_size: int):
        self.top_n, self.vocab_size = top_n, vocab_size
        self.index: dict[str, tuple] = {}  # prompt key -> (handle, completion span)
        self.missed: dict[str, int] = {}  # why sequences were not served: how many
        self.unreadable: list[str] = []  # parts that could not be read: their answers' rows
        for out in outs:  # are computed, as if they had not been kept
            for path in sorted((Path(out) / CAPTURED).glob("part-*.safetensors")):
                try:
                    handle = safe_open(str(path), framework="pt")
                    meta = handle.metadata() or {}
                    if meta.get("top_n") == str(top_n) and meta.get("vocab_size") == str(
                        vocab_size
                    ):  # else kept at another N or over other columns: not served
                        self._index(handle)
                except Exception as e:  # a damaged part: its answers take the forward
                    self.unreadable.append(f"{path}: {type(e).__name__}: {e}")

    def _index(self, handle) -> None:
        prompts = handle.get_tensor("prompt_ids")
        p_off = handle.get_tensor("prompt_offsets").tolist()
        c_off = handle.get_tensor("completion_offsets").tolist()
        rows = c_off[-1]
        shapes = [handle.get_slice(k).get_shape()[0] for k in ("indices", "logprobs", "rest")]
        widths = {handle.get_slice(k).get_shape()[1] for k in ("indices", "logprobs")}
        if (
            len(p_off) != len(c_off)
            or p_off[-1] != len(prompts)
            or handle.get_slice("completion_ids").get_shape()[0] != rows
            or shapes != [rows] * 3
            or widths != {self.top_n}
        ):
            raise ValueError("its tensors do not agree with its offsets")
        for r in range(len(p_off) - 1):
            key = _prompt_key(prompts[p_off[r] : p_off[r + 1]])
            self.index[key] = (handle, c_off[r], c_off[r + 1])

    def __len__(self) -> int:
        return len(self.index)

    def _miss(self, reason: str) -> None:
        self.missed[reason] = self.missed.get(reason, 0) + 1

    def rows(self, input_ids: torch.Tensor, valid: torch.Tensor):
        """(indices [n, N] int64, logprobs [n, N] fp32, rest [n] fp32) at the `valid`
        positions (a sequence's [L − 1] bool, `train.target_cache.valid_rows`) of the
        sequence `input_ids` [L], or None when it is not a captured answer's tokens (the
        reason counted in `missed`)."""
        where = valid.nonzero().squeeze(-1)
        start = int(where[0]) + 1 if len(where) else 0  # the first trained token
        found = self.index.get(_prompt_key(input_ids[:start])) if len(where) else None
        if found is None:  # the prompt is what precedes the first trained token
            return self._miss("no kept prompt")
        handle, a, b = found
        steps = where + 1 - start  # the answer token each valid position predicts
        last = int(steps[-1])
        if last >= b - a:
            return self._miss("more tokens than were generated")
        # step j's distribution is the target's given the prompt and the first j generated
        # tokens, whichever token was then drawn: those tokens must be the sequence's
        conditioning = handle.get_slice("completion_ids")[a : a + last].long()
        if not torch.equal(conditioning, input_ids[start : start + last].long()):
            return self._miss("tokenized otherwise than generated")
        indices = handle.get_slice("indices")[a:b].long()[steps]
        logprobs = handle.get_slice("logprobs")[a:b].float()[steps]
        rest = handle.get_slice("rest")[a:b].float()[steps]
        return indices, logprobs, rest
