"""Building a target cache (train/target_cache.py describes the format): one pass of the
recipe's frozen target over its training and eval sequences, batch by batch, into shards,
then the manifest; the directory is written beside `out` and renamed into place.

    specdistill cache --recipe recipes/code.yaml --out runs/code-cache --top-n 64
"""

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from specdistill import drafts
from specdistill.data import collate
from specdistill.drafts.align import shifted_logits
from specdistill.drafts.eagle3.features import FeatureCapture, decoder_layers
from specdistill.models import hub
from specdistill.models.target_spec import TargetSpec, load_target_and_tokenizer
from specdistill.progress import WorkProgress
from specdistill.publish import atomic_write_text, publish_dir
from specdistill.train.config import recipe_datasets
from specdistill.train.recipe_checks import cache_checks
from specdistill.train.recipe_errors import RecipeError
from specdistill.train.target_cache import (
    DEFAULT_SHARD_BYTES,
    DEFAULT_TOP_N,
    MANIFEST,
    SPLITS,
    VALUE_DTYPES,
    VERSION,
    CacheError,
    data_hash,
    target_identity,
    tokenizer_hash,
    valid_rows,
)
from specdistill.train.target_cache_shards import FORMAT, ShardFeatures, ShardWriter, rest_mass
from specdistill.train.target_cache_vocab import (
    COLUMNS,
    head_logits,
    place_rows,
    vocab_rows,
    vocab_rows_of,
)

AHEAD = 16  # batches whose hidden states another engine is asked for at once


class HiddenStates(Protocol):
    """Another engine's pass over the target (eval/vllm_features.py): per sequence of token
    ids, [len, n · H] float32, the hidden states entering the layers it was started with, side
    by side, the last of them the last layer's output before the final norm."""

    description: str

    def hidden_states(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]: ...

    def close(self) -> None: ...


class Prefetched:
    """A `HiddenStates` asked ahead for many sequences at once (an engine like vLLM batches
    what it is given), then served one batch at a time until the next `ahead` replaces them;
    a sequence not asked ahead is fetched when asked."""

    def __init__(self, engine: HiddenStates):
        self.engine, self.description = engine, engine.description
        self.stored: dict[tuple[int, ...], torch.Tensor] = {}

    def ahead(self, sequences: Sequence[Sequence[int]]) -> None:
        states = self.engine.hidden_states(sequences)
        self.stored = dict(zip(map(tuple, sequences), states, strict=True))

    def hidden_states(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        keys = [tuple(s) for s in sequences]
        missing = [list(k) for k in dict.fromkeys(keys) if k not in self.stored]
        if missing:
            states = self.engine.hidden_states(missing)
            self.stored.update(zip(map(tuple, missing), states, strict=True))
        return [self.stored[k] for k in keys]

    def close(self) -> None:
        self.engine.close()


@torch.no_grad()
def top_n_rows(target, batch: dict, vocab_size: int, top_n: int):
    """(indices [R, N] int64, logprobs [R, N] fp32, rest [R] fp32, rows per item [B]) of one
    collated batch: the target's top-N log-softmax over `vocab_size` columns at each valid
    position, items in order, positions in order."""
    logits = shifted_logits(target, batch, vocab_size)
    mask = valid_rows(batch)
    logp = logits[mask].float().log_softmax(-1)
    values, indices = logp.topk(top_n, dim=-1)  # sorted, most probable first
    return indices, values, rest_mass(values), mask.sum(1)


def build_cache(
    recipe,
    out: str | os.PathLike,
    *,
    top_n: int = DEFAULT_TOP_N,
    columns: str = "top-n",
    values_dtype: str = "float16",
    splits: tuple[str, ...] = SPLITS,
    target=None,
    tokenizer=None,
    train_data=None,
    eval_data=None,
    batch_size: int | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    device: str | torch.device | None = None,
    captured=None,
    hidden_states: Callable[[list[int]], HiddenStates] | None = None,
    print=print,
) -> dict:
    """Build the cache of `recipe`'s target over its data into `out`; return the manifest.

    columns: "top-n" (the target's `top_n` most probable tokens and the rest mass) or
    "draft" (its log-probabilities over the recipe's draft's own columns:
    train/target_cache_vocab.py). A recipe that distill would refuse with such a cache is
    refused before anything loads. The models and datasets are loaded as
    `Trainer.from_recipe` loads them unless given. `out` must not exist (or be empty) unless
    `overwrite`. `captured` (`train.captured.CapturedOutputs`, top-N at its N): the rows
    of the sequences it serves are read from it. `hidden_states` (given the layers: the
    features' and the last, `HiddenStates` started over the same target): for an EAGLE-3
    head's cache, the features and the log-probabilities come from its pass (the
    log-probabilities through this target's final norm and output head) instead of this
    target's forward."""
    r, out = recipe, Path(out)
    _check_build_arguments(out, top_n, values_dtype, batch_size, shard_bytes, overwrite)
    _check_build_recipe(r, columns)
    target, tokenizer, train_data, eval_data = _build_inputs(
        r, target, tokenizer, train_data, eval_data
    )
    vocab_size = hub.shared_vocab_size(target, None, tokenizer)
    ids, layers = (None, None)
    if columns == "draft":  # the draft's columns' target ids, the layers its features enter
        ids, layers = _draft_columns(r, target, tokenizer, train_data, print)
    top_n = _stored_width(top_n, ids, captured, vocab_size)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target = target.eval().requires_grad_(False).to(device)
    dtype = VALUE_DTYPES[values_dtype]
    row_bytes = top_n * ((4 if ids is None else 0) + dtype.itemsize) + dtype.itemsize
    width = 0 if layers is None else len(layers) * target.config.hidden_size
    build = _Build(
        target=target,
        tokenizer=tokenizer,
        device=device,
        vocab_size=vocab_size,
        top_n=top_n,
        batch_size=batch_size or r.train.micro_batch_size,
        dtype=dtype,
        # a shard's size counts the features as if one position came with each row (≥ 1 do)
        max_rows=max(1, shard_bytes // (row_bytes + width * dtype.itemsize)),
        ids=ids,
        feature_layers=layers,
        feature_width=width,
        captured=captured,
    )
    if hidden_states is not None and layers is not None:
        build.hidden = Prefetched(hidden_states([*layers, len(decoder_layers(target))]))
    try:
        datasets = {split: {"train": train_data, "eval": eval_data}[split] for split in splits}
        return _write(r, build, out, datasets, values_dtype, row_bytes, overwrite, print)
    finally:
        if build.hidden is not None:
            build.hidden.close()


def _write(r, build, out: Path, datasets: dict, values_dtype, row_bytes, overwrite, print):
    """Write each split of `datasets` and the manifest beside `out`, then rename the
    directory into place; -> the manifest."""
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    start = time.perf_counter()
    try:
        manifest_splits = {
            split: build.write_split(tmp, split, data, print) for split, data in datasets.items()
        }
        manifest = _build_manifest(r, build, values_dtype, row_bytes, manifest_splits, start)
        atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1))
        if out.exists():
            if not overwrite and any(out.iterdir()):
                raise CacheError(f"{out} appeared during the build; not replacing it")
        publish_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _stored_width(top_n: int, ids, captured, vocab_size: int) -> int:
    """The values stored per position: `top_n`, or the draft's columns `ids`; CacheError
    when it exceeds the vocabulary or differs from the `captured` outputs' N."""
    width = top_n if ids is None else len(ids)
    if captured is not None and (ids is not None or captured.top_n != width):
        stored = "the draft columns" if ids is not None else f"the top {width}"
        raise CacheError(
            f"captured outputs hold the top {captured.top_n}; this cache stores {stored}"
        )
    if width > vocab_size:
        raise CacheError(f"--top-n {width} exceeds the vocabulary ({vocab_size} tokens)")
    return width


def _check_build_arguments(
    out: Path,
    top_n: int,
    values_dtype: str,
    batch_size: int | None,
    shard_bytes: int,
    overwrite: bool,
) -> None:
    """Raise CacheError naming the first argument out of range, before anything loads."""
    if top_n < 1:
        raise CacheError(f"--top-n must be >= 1, got {top_n}")
    if values_dtype not in VALUE_DTYPES:
        raise CacheError(f"values dtype must be one of {', '.join(VALUE_DTYPES)}")
    if batch_size is not None and batch_size < 1:
        raise CacheError(f"--batch-size must be >= 1, got {batch_size}")
    if shard_bytes < 1:
        raise CacheError(f"--shard-mb must give a shard size of at least 1 byte, got {shard_bytes}")
    if out.exists() and not out.is_dir():
        raise CacheError(f"--out {out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise CacheError(f"{out} exists and is not empty; pass --overwrite to replace it")


def _check_build_recipe(r, columns: str) -> None:
    """Refuse, before anything loads, a cache that distill would refuse to train on."""
    if columns not in COLUMNS:
        raise CacheError(f"--columns takes {' or '.join(COLUMNS)}, got {columns!r}")
    try:
        cache_checks(r, columns)
    except RecipeError as e:
        raise CacheError(f"distill could not train on this cache: {e}") from None


def _draft_columns(r, target, tokenizer, train_data, print) -> tuple:
    """(the target ids of the recipe's draft's K columns, the target layers whose input
    hidden states it reads or None), as distill builds that draft."""
    _, kind = drafts.build(r.draft, target, tokenizer, train_data, print=print)
    return kind.draft_ids().cpu(), kind.feature_layers


def _build_inputs(r, target, tokenizer, train_data, eval_data) -> tuple:
    """(target, tokenizer, train_data, eval_data): each loaded from the recipe unless given,
    as `Trainer.from_recipe` loads them (models/target_spec.py: the tokenizer pads with its
    eos token if unset)."""
    target, tokenizer = load_target_and_tokenizer(
        TargetSpec.from_recipe(r.target), target=target, tokenizer=tokenizer
    )
    if train_data is None or eval_data is None:
        train_data, eval_data = recipe_datasets(r, tokenizer)
    return target, tokenizer, train_data, eval_data


@dataclass
class _Build:
    """What each split's pass over the target needs: the target on its device, the
    tokenizer (its pad id), the stored columns and the batch and shard sizes."""

    target: object
    tokenizer: object
    device: torch.device
    vocab_size: int
    top_n: int
    batch_size: int
    dtype: torch.dtype
    max_rows: int
    ids: torch.Tensor | None = None  # the draft's columns' target ids ("draft"), else top-N
    feature_layers: list[int] | None = None  # the hidden states stored too (an EAGLE-3 head's)
    feature_width: int = 0  # their width: n_layers × the target's hidden size
    captured: object | None = None  # a train.captured.CapturedOutputs serving top-N rows
    hidden: "Prefetched | None" = None  # the features from another engine's pass (vLLM's)

    def rows(self, batch: dict) -> tuple:
        """The arguments of `ShardWriter.add` for one collated batch: the target's rows, and
        the hidden states entering `feature_layers`, captured in the same forward."""
        if self.ids is None:
            return top_n_rows(self.target, batch, self.vocab_size, self.top_n), {}
        if self.feature_layers is None:
            return vocab_rows(self.target, batch, self.vocab_size, self.ids), {}
        if self.hidden is not None:
            return self.rows_from_hidden(batch)
        with FeatureCapture(self.target, self.feature_layers) as capture:
            rows = vocab_rows(self.target, batch, self.vocab_size, self.ids)
        features = {"features": capture.features(), "attention_mask": batch["attention_mask"]}
        return rows, features

    def rows_from_hidden(self, batch: dict) -> tuple:
        """`rows` from the `hidden` engine's pass: its features, and the log-probabilities
        from its last layer's output through the target's final norm and output head."""
        mask = batch["attention_mask"].bool()  # right-padded: item b's tokens come first
        sequences = [batch["input_ids"][b, mask[b]].tolist() for b in range(len(mask))]
        states = self.hidden.hidden_states(sequences)
        width = self.feature_width + self.target.config.hidden_size
        placed = place_rows(mask, width, states, _hidden_mismatch)
        logits = head_logits(self.target, placed[..., self.feature_width :])
        rows = vocab_rows_of(logits[:, :-1, : self.vocab_size], batch, self.ids)
        features = placed[..., : self.feature_width]
        return rows, {"features": features, "attention_mask": batch["attention_mask"]}

    def rows_of(self, items: list[dict]) -> tuple:
        """`rows` for dataset items: those the captured outputs serve are read, the others
        run through the target together."""
        pad = self.tokenizer.pad_token_id
        if self.captured is None:
            return self.rows({k: v.to(self.device) for k, v in collate(items, pad).items()})
        valid = valid_rows(collate(items, pad))  # right-padded: item b's are its first L_b − 1
        served = [
            self.captured.rows(it["input_ids"], valid[b, : len(it["input_ids"]) - 1])
            for b, it in enumerate(items)
        ]
        missing = [it for it, got in zip(items, served, strict=True) if got is None]
        if missing:
            batch = {k: v.to(self.device) for k, v in collate(missing, pad).items()}
            indices, values, rest, counts = self.rows(batch)[0]
            parts = zip(*(t.split(counts.tolist()) for t in (indices, values, rest)), strict=True)
            computed = iter(parts)
            served = [got if got is not None else next(computed) for got in served]
        indices, values, rest = (torch.cat(t) for t in zip(*served, strict=True))
        counts = torch.tensor([len(got[0]) for got in served])
        return (indices, values, rest, counts), {}

    def write_split(self, tmp: Path, split: str, data, print) -> dict:
        """Run the target over `data` (or read the captured rows) and write `split`'s shards
        into `tmp`; return the split's manifest entry."""
        stored = None if self.feature_layers is None else ShardFeatures(self.dtype)
        writer = ShardWriter(tmp, split, self.max_rows, self.dtype, stored)
        progress = WorkProgress(f"cache {split}", len(data)) if len(data) else None
        try:
            for first in range(0, len(data), self.batch_size):
                if self.hidden is not None and first % (self.batch_size * AHEAD) == 0:
                    ahead = range(first, min(first + self.batch_size * AHEAD, len(data)))
                    self.hidden.ahead([data[i]["input_ids"].tolist() for i in ahead])
                items = [data[i] for i in range(first, min(first + self.batch_size, len(data)))]
                rows, features = self.rows_of(items)
                writer.add(*rows, **features)
                if progress is not None:
                    progress.advance(len(items), f"{first + len(items)}/{len(data)} sequences")
        finally:
            if progress is not None:
                progress.close()
        writer.flush()
        rows = sum(s["rows"] for s in writer.shards)
        entry = {
            "sequences": len(data),
            "positions": rows,
            "data_hash": data_hash(data),
            "shards": writer.shards,
        }
        if self.captured is not None:  # how many the capture served (a build does one split)
            missed = dict(sorted(self.captured.missed.items()))
            computed = sum(missed.values())  # each sequence asked once, each miss counted
            served = len(data) - computed
            entry["captured"] = {"served": served, "computed": computed, "why": missed}
            self.captured.missed.clear()
        print(f"cache: {split}: {len(data)} sequences, {rows} positions{_served(entry)}")
        return entry


def _hidden_mismatch(b: int, n: int, valid: int) -> CacheError:
    return CacheError(f"the hidden states of sequence {b} have {n} rows for its {valid} tokens")


def _served(entry: dict) -> str:
    """', N of them from the captured outputs' for a split built with them, else ''."""
    if "captured" not in entry:
        return ""
    return f", {entry['captured']['served']} of them from the outputs captured while answering"


def _build_manifest(
    r, build: _Build, values_dtype: str, row_bytes: int, manifest_splits: dict, start: float
) -> dict:
    """The cache's manifest.json: what it was built from (tokenizer, target, data) and its
    sizes; `start`: the build's `time.perf_counter()`."""
    total_bytes = sum(s["bytes"] for m in manifest_splits.values() for s in m["shards"])
    positions = sum(m["positions"] for m in manifest_splits.values())
    return {
        "format": FORMAT,
        "version": VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_seconds": round(time.perf_counter() - start, 3),
        "tokenizer_hash": tokenizer_hash(build.tokenizer),
        "target": target_identity(r.target, build.target),
        "data": {
            "train": list(r.data.train),
            "eval": None if r.data.eval is None else list(r.data.eval),
            "max_length": r.data.max_length,
            "pack": r.data.pack,
            "eval_fraction": r.data.eval_fraction,
            "seed": r.train.seed,
        },
        "top_n": build.top_n,
        "columns": "top-n" if build.ids is None else "draft",
        "draft_ids": None if build.ids is None else build.ids.tolist(),
        # the hidden states entering these target layers at every attended position
        "features": None
        if build.feature_layers is None
        else {
            "layers": list(build.feature_layers),
            "width": build.feature_width,
            "dtype": values_dtype,
            # the engine whose pass gave them (and the log-probabilities)
            "engine": "specdistill" if build.hidden is None else build.hidden.description,
        },
        "temperature": 1.0,  # raw log-softmax; the loss temperature is applied at read
        "vocab_size": build.vocab_size,
        "indices_dtype": "int32",  # [rows, 0] with columns "draft"
        "values_dtype": values_dtype,
        "rest_dtype": values_dtype,
        # per stored position: N indices (none with columns "draft") + N values + the rest
        "bytes_per_position": row_bytes,
        # on disk, shard headers and offsets included, per stored position
        "bytes_per_token": total_bytes / max(positions, 1),
        "total_bytes": total_bytes,
        "positions": positions,
        "splits": manifest_splits,
    }
