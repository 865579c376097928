"""A compact target cache: the frozen target's top-N log-probabilities, computed once.

    specdistill cache --recipe recipes/code.yaml --out runs/code-cache --top-n 64
    specdistill distill --recipe recipes/code.yaml target.cache=runs/code-cache

A draft over a reduced vocabulary takes a cache of its own columns instead
(`--columns draft`: train/target_cache_vocab.py), exact and read as a `losses.VocabTarget`.

`build_cache` (train/target_cache_build.py) runs the recipe's target over the recipe's
training and eval sequences (the very TokenDataset items the trainer batches: same
tokenizer, sources, max_length, packing,
eval split and seed) and stores, for every valid position (a position t whose next token is
a training target, `drafts.align.target_mask`), the target's N most probable tokens:

    DIR/manifest.json              what the cache was built from, its sizes (MANIFEST below)
    DIR/train-000000.safetensors   indices [R, N] int32, logprobs [R, N] float16,
    DIR/train-000001.safetensors   rest [R] float16 (1 − Σ top-N p: the dropped mass),
    DIR/eval-000000.safetensors    offsets [S + 1] int64 (sequence s's rows: offsets[s:s+2])

A shard holds whole sequences, `first_sequence` to `first_sequence + sequences − 1`, rows in
sequence order then position order. The log-probabilities are the target's at temperature 1
over the tokenizer's ids (the columns the trainer compares, `hub.shared_vocab_size`). The
whole directory is written beside DIR and renamed into place (specdistill/publish.py), so a
killed build leaves no half cache under DIR.

With `target.cache: DIR` the trainer (standalone drafts) builds its depth-0 target from the
cache, a `losses.SparseTarget` of the top-N probabilities with the stored remaining mass as
a rest bin (docs/theory.md §3, "Sparse targets with a rest bin": target and draft are
compared on the N tokens plus one bin for every other token), instead of running the
target. The loss is therefore at temperature 1, unfiltered: the cache knows the dropped
mass only there. The manifest is compared with the run's tokenizer, target and data, and
every shard the run reads with its manifest entry (size, header, offsets, the split and first
sequence written into it: train/target_cache_shards.py), before any training (`open_cache`);
held-out evaluation still runs the live target, so the reported α is the true one.
docs/cache.md gives the sizes.
"""

import bisect
import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from specdistill.drafts.align import target_mask
from specdistill.errors import UserError
from specdistill.losses import SparseTarget
from specdistill.models.identity import model_identity
from specdistill.train.target_cache_shards import FORMAT, shard_problem
from specdistill.train.target_cache_vocab import (
    draft_ids_problem,
    place_rows,
    place_vocab_rows,
)

VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "eval")
VALUE_DTYPES = {"float16": torch.float16, "float32": torch.float32}
DEFAULT_TOP_N = 64
DEFAULT_SHARD_BYTES = 256 * 1024 * 1024


class CacheError(UserError):
    """A cache directory that cannot serve this run (missing, damaged or built for another
    tokenizer, target or dataset). The trainer re-raises it as a RecipeError."""


# ----------------------------------------------------------------------------- identities
def tokenizer_hash(tokenizer) -> str:
    """sha256 over the tokenizer's vocabulary (token → id, as JSON with sorted keys) and its
    eos id: equal for tokenizers that map every string to the same ids."""
    h = hashlib.sha256()
    h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True, ensure_ascii=False).encode())
    h.update(f"\0eos={tokenizer.eos_token_id}".encode())
    return "sha256:" + h.hexdigest()


def data_hash(dataset) -> str:
    """sha256 over a TokenDataset's items: each sequence's length, token ids (int32) and loss
    mask. Equal iff the trainer would see the same sequences in the same order."""
    h = hashlib.sha256()
    h.update(f"{len(dataset)}\0".encode())
    for i in range(len(dataset)):
        item = dataset[i]
        ids = item["input_ids"].to(torch.int32).contiguous()
        h.update(len(ids).to_bytes(8, "little"))
        h.update(ids.numpy().tobytes())
        h.update(item["loss_mask"].to(torch.uint8).contiguous().numpy().tobytes())
    return "sha256:" + h.hexdigest()


def target_identity(target_cfg, model=None) -> dict:
    """What names the target's distributions: its model (`models.identity.model_identity`,
    sha256 of config and weights), adapter (when the recipe has `target.adapter`), dtype."""
    adapter = getattr(target_cfg, "adapter", None)
    identity = model_identity(target_cfg.model, model, adapter)  # the adapter's files too
    return {
        "model": target_cfg.model,
        "revision": target_cfg.revision,
        "adapter": adapter,
        "dtype": target_cfg.dtype,
        "identity": identity,
    }


# ----------------------------------------------------------------------------- reading
def valid_rows(batch: dict) -> torch.Tensor:
    """[B, L−1] bool: the positions the cache stores (the trainer's depth-0 mask)."""
    return target_mask(batch)


class TargetCache:
    """A built cache, read lazily (memory-mapped safetensors shards)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        manifest = self.path / MANIFEST
        if not manifest.is_file():
            raise CacheError(
                f"target.cache {self.path}: no {MANIFEST} (not a target cache, or a build that "
                f"did not finish); build it with `specdistill prepare --recipe R` (a recipe with "
                f"a prepare section) or `specdistill cache --recipe R --out {self.path}`"
            )
        try:
            self.manifest = json.loads(manifest.read_text())
        except ValueError as e:
            raise CacheError(f"target.cache {manifest}: not valid JSON ({e})") from None
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != VERSION:
            raise CacheError(
                f"target.cache {self.path}: format {self.manifest.get('format')!r} version "
                f"{self.manifest.get('version')!r}, expected {FORMAT!r} version {VERSION}"
            )
        missing = [
            key
            for key in ("tokenizer_hash", "target", "vocab_size", "splits", "top_n")
            if key not in self.manifest
        ]
        if missing:
            raise CacheError(f"target.cache {manifest} lacks {', '.join(missing)}")
        self.top_n = self.manifest["top_n"]
        self.columns = self.manifest.get("columns", "top-n")
        self.features = self.manifest.get("features")  # {layers, width, dtype} or None
        self._handles: dict[str, object] = {}
        self._kind = None  # the draft type served (`bind`), with columns "draft"

    def check(self, *, tokenizer, target_cfg, target, datasets: dict, vocab_size: int) -> None:
        """Raise CacheError unless the cache was built for this tokenizer, target and data.
        `datasets`: split name -> TokenDataset, the splits the run will read."""
        m, where = self.manifest, f"target.cache {self.path}"
        rebuild = "; rebuild it (`specdistill cache --recipe R --out DIR`) or unset target.cache"
        if m["tokenizer_hash"] != tokenizer_hash(tokenizer):
            raise CacheError(
                f"{where} was built with another tokenizer (vocabulary hash "
                f"{m['tokenizer_hash'][:19]}… ≠ {tokenizer_hash(tokenizer)[:19]}… of "
                f"{target_cfg.model}){rebuild}"
            )
        ours = target_identity(target_cfg, target)
        theirs = m["target"]
        if theirs["identity"] != ours["identity"] or theirs["dtype"] != ours["dtype"]:
            raise CacheError(
                f"{where} was built for another target: {theirs['model']} ({theirs['dtype']}, "
                f"{theirs['identity'][:19]}…), this recipe's is {ours['model']} "
                f"({ours['dtype']}, {ours['identity'][:19]}…){rebuild}"
            )
        if m["vocab_size"] != vocab_size:
            raise CacheError(
                f"{where} covers {m['vocab_size']} vocabulary columns, this run compares "
                f"{vocab_size}{rebuild}"
            )
        for split, data in datasets.items():
            if split not in m["splits"]:
                raise CacheError(f"{where} has no {split} split{rebuild}")
            stored = m["splits"][split]
            if stored["data_hash"] != data_hash(data):
                raise CacheError(
                    f"{where} was built on another {split} dataset ({stored['sequences']} "
                    f"sequences, data hash {stored['data_hash'][:19]}…; this recipe's has "
                    f"{len(data)} sequences, {data_hash(data)[:19]}…): data sources, "
                    f"max_length, pack, eval split or seed differ{rebuild}"
                )
        self.check_shards()

    def check_shards(self) -> None:
        """Raise CacheError naming the first damaged shard of any split (train and eval alike,
        whether or not this run reads it): train/target_cache_shards.py's `shard_problem`."""
        for split, stored in self.manifest["splits"].items():
            for info in stored.get("shards", []):
                width = 0 if self.columns == "draft" else self.top_n
                problem = shard_problem(
                    self.path / info["file"],
                    split,
                    info,
                    self.top_n,
                    index_width=width,
                    feature_width=None if self.features is None else self.features["width"],
                )
                if problem:
                    raise CacheError(
                        f"target.cache shard {self.path / info['file']} {problem}; rebuild the "
                        "cache (`specdistill cache --recipe R --out DIR --overwrite`)"
                    )

    def _shard(self, split: str, sequence: int):
        shards = self.manifest["splits"][split]["shards"]
        firsts = [s["first_sequence"] for s in shards]
        k = bisect.bisect_right(firsts, sequence) - 1
        info = shards[k]
        if not 0 <= sequence - info["first_sequence"] < info["sequences"]:
            raise IndexError(f"sequence {sequence} is not in the {split} cache")
        key = info["file"]
        if key not in self._handles:
            self._handles[key] = safe_open(str(self.path / key), framework="pt")
        return self._handles[key], sequence - info["first_sequence"]

    def rows(self, split: str, sequence: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indices [n, N] int64, logprobs [n, N] fp32, rest [n] fp32) of one sequence's
        valid positions."""
        handle, local = self._shard(split, sequence)
        offsets = handle.get_slice("offsets")[local : local + 2]
        a, b = int(offsets[0]), int(offsets[1])
        indices = handle.get_slice("indices")[a:b].long()
        logprobs = handle.get_slice("logprobs")[a:b].float()
        rest = handle.get_slice("rest")[a:b].float()
        return indices, logprobs, rest

    def stored_features(self, split: str, sequences, attention_mask: torch.Tensor):
        """The batch's stored hidden states [B, T, F] at its attended positions (zeros at
        padding), for `attention_mask` [B, T]."""
        rows = []
        for sequence in sequences:
            handle, local = self._shard(split, int(sequence))
            offsets = handle.get_slice("feature_offsets")[local : local + 2]
            rows.append(handle.get_slice("features")[int(offsets[0]) : int(offsets[1])])

        def mismatch(b: int, have: int, want: int) -> Exception:
            return CacheError(
                f"target.cache {self.path}: {split} sequence {int(sequences[b])} has "
                f"{have} stored positions, the batch {want}"
            )

        return place_rows(attention_mask.bool(), self.features["width"], rows, mismatch)

    def sparse_target(self, split: str, sequences, mask: torch.Tensor):
        """The batch's target as a SparseTarget [B, L−1, N] with its rest [B, L−1] (the top-N
        probabilities and the mass they leave; the loss scales the two to sum to 1, which
        absorbs the float16 rounding) for the mask [B, L−1] of `valid_rows`."""
        rows = []
        for sequence in sequences:
            indices, logprobs, rest = self.rows(split, int(sequence))
            rows.append((indices, logprobs.exp(), rest))

        def mismatch(b: int, have: int, want: int) -> Exception:
            return CacheError(
                f"target.cache {self.path}: {split} sequence {int(sequences[b])} has "
                f"{have} cached positions, the batch {want}"
            )

        return place_sparse_rows(mask, self.top_n, rows, mismatch)

    def bind(self, kind) -> None:
        """Serve the draft type `kind` (a `drafts.types.DraftType`), which must train on this
        cache's columns (its capabilities); a cache over a draft's columns must hold this
        draft's K ids in its order. CacheError otherwise."""
        can = kind.capabilities
        wanted = "vocab_targets" if self.columns == "draft" else "sparse_targets"
        generic = (
            f"target.cache {self.path} holds the target over a reduced draft vocabulary's "
            "columns, which this draft does not have: rebuild it with --columns top-n"
            if self.columns == "draft"
            else f"target.cache {self.path} is a top-N cache, which this draft type does not "
            "train on: unset target.cache"
        )
        refusal = can.refusal(wanted, generic)
        if refusal:
            raise CacheError(refusal)
        if self.columns != "draft":
            self._kind = kind
            return
        rebuild = (
            "; rebuild it (`specdistill prepare --recipe R`, or `specdistill cache --recipe R "
            "--columns draft --out DIR --overwrite`)"
        )
        stored = None if self.features is None else self.features["layers"]
        if kind.feature_layers is not None and stored != kind.feature_layers:
            what = "no hidden states" if stored is None else f"the inputs of layers {stored}"
            raise CacheError(
                f"target.cache {self.path} holds {what}; this draft reads the target's hidden "
                f"states entering layers {kind.feature_layers}{rebuild}"
            )
        problem = draft_ids_problem(self.manifest.get("draft_ids") or [], kind.draft_ids())
        if problem:
            raise CacheError(f"target.cache {self.path} {problem}{rebuild}")
        self._kind = kind

    def vocab_target(self, split: str, sequences, mask: torch.Tensor):
        """The batch's target as a `losses.VocabTarget` [B, L−1, K] (columns "draft")."""
        rows = [self.rows(split, int(s))[1] for s in sequences]

        def mismatch(b: int, have: int, want: int) -> Exception:
            return CacheError(
                f"target.cache {self.path}: {split} sequence {int(sequences[b])} has "
                f"{have} cached positions, the batch {want}"
            )

        return place_vocab_rows(mask, self.top_n, rows, mismatch)

    def depths(self, draft, batch: dict, vocab_size: int, split: str = "train"):
        """The draft's (drafts, targets, masks) with the target from the cache, as the draft
        type's `depths` returns them with the live target: the bound type's `stored_depths`
        of the stored rows (over the draft's own columns with the stored features it reads,
        or the top N over the target's ids). `batch["sequence"]` [B]: the dataset index of
        each row."""
        if self._kind is None:
            raise CacheError(f"target.cache {self.path}: bind() it to the draft type first")
        mask = valid_rows(batch)
        sequences = batch["sequence"].tolist()
        if self.columns != "draft":
            target = self.sparse_target(split, sequences, mask)
            return self._kind.stored_depths(draft, batch, target)
        features = None
        if self._kind.feature_layers is not None:
            features = self.stored_features(split, sequences, batch["attention_mask"])
        target = self.vocab_target(split, sequences, mask)
        return self._kind.stored_depths(draft, batch, target, features)


def place_sparse_rows(mask: torch.Tensor, top_n: int, rows: list, mismatch):
    """A SparseTarget [B, L−1, top_n] with rest [B, L−1] from per-item rows: item b's
    (indices [n, top_n] int64, probs [n, top_n], rest [n]) go to the valid positions of
    mask[b], in order; masked positions hold a uniform placeholder. An item whose n differs
    from its number of valid positions raises `mismatch(b, n, valid)`. Shared by the target
    cache and the online job's records (train/online/traffic.py RecordTargets)."""
    shape = (*mask.shape, top_n)
    indices = torch.arange(top_n, device=mask.device).expand(shape).clone()
    probs = torch.full(shape, 1.0 / top_n, device=mask.device)
    rest = torch.zeros(mask.shape, device=mask.device)
    for b, (idx, p, dropped) in enumerate(rows):
        where = mask[b].nonzero().squeeze(-1)
        if len(where) != len(idx):
            raise mismatch(b, len(idx), len(where))
        indices[b, where] = idx.to(mask.device)
        probs[b, where] = p.to(probs.dtype).to(mask.device)
        rest[b, where] = dropped.to(rest.dtype).to(mask.device)
    return SparseTarget(indices, probs, rest)


def open_cache(recipe, *, tokenizer, target, train_data, vocab_size: int, kind=None) -> TargetCache:
    """The recipe's `target.cache`, checked against this run (and, given the draft type
    `kind`, bound to it) before any training."""
    cache = TargetCache(recipe.target.cache)
    cache.check(
        tokenizer=tokenizer,
        target_cfg=recipe.target,
        target=target,
        datasets={"train": train_data},
        vocab_size=vocab_size,
    )
    if kind is not None:
        cache.bind(kind)
    return cache
