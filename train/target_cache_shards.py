"""A target cache's shard files (train/target_cache.py): their writing, and the check that a shard
file is the one the manifest lists.

A shard that was truncated, replaced, renamed or swapped with another is found before any
training starts, from its size, its safetensors header, its offsets and the split and first
sequence the build wrote into its metadata (caches built without that metadata are checked
without it). Only the header and the offsets are read.
"""

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "specdistill-target-cache"


def rest_mass(logprobs: torch.Tensor) -> torch.Tensor:
    """[..., N] stored log-probabilities -> [...] the mass they leave, 1 − Σ p (≥ 0): a
    shard row's `rest`."""
    return (1.0 - logprobs.exp().sum(-1)).clamp_min(0.0)


def shard_problem(
    path: Path,
    split: str,
    info: dict,
    top_n: int,
    index_width: int | None = None,
    feature_width: int | None = None,
) -> str | None:
    """What is wrong with the shard file `path` given its manifest entry `info` (file, bytes,
    rows, sequences, first_sequence, and `feature_rows` with features) of `split`, as a phrase
    following the file's name; None if nothing is. index_width: the indices' columns (top_n
    unless given; 0 for a cache over a draft's columns); feature_width: the stored hidden
    states' width (None: the cache stores none)."""
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != info["bytes"]:
        return f"has {size} bytes, the manifest {info['bytes']} (truncated, replaced or swapped)"
    rows, sequences = info["rows"], info["sequences"]
    want = {
        "indices": [rows, top_n if index_width is None else index_width],
        "logprobs": [rows, top_n],
        "rest": [rows],
        "offsets": [sequences + 1],
    }
    if feature_width is not None:
        want["features"] = [info.get("feature_rows", -1), feature_width]
        want["feature_offsets"] = [sequences + 1]
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            shapes = {k: list(handle.get_slice(k).get_shape()) for k in handle.keys()}
            offsets = handle.get_tensor("offsets") if shapes == want else None
    except Exception as e:  # safetensors' own error type for a damaged header
        return f"cannot be read ({type(e).__name__}: {e})"
    if shapes != want:
        return f"holds tensors {shapes}, the manifest says {want}"
    expected = {"split": split, "first_sequence": str(info["first_sequence"])}
    for key, value in expected.items():
        if key in meta and meta[key] != value:
            return (
                f"was written as {key} {meta[key]}, the manifest lists it as {value} "
                "(shards renamed or swapped)"
            )
    if int(offsets[0]) != 0 or int(offsets[-1]) != rows or bool((offsets.diff() < 0).any()):
        return f"has offsets that do not cover rows 0..{rows} in order"
    return None


class ShardFeatures:
    """The hidden states a shard stores beside the target's rows (an EAGLE-3 head's
    features): every attended position of each sequence, [P, F], with `feature_offsets`."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.reset()

    def reset(self) -> None:
        self.rows: list[torch.Tensor] = []

    def add(self, features: torch.Tensor, attended: torch.Tensor) -> None:
        """One item's features [T, F] at its attended positions (`attended` [T] bool)."""
        self.rows.append(features[attended.bool()].to(self.dtype).cpu())

    def tensors(self) -> dict[str, torch.Tensor]:
        offsets = torch.zeros(len(self.rows) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor([len(r) for r in self.rows], dtype=torch.int64).cumsum(0)
        return {"features": torch.cat(self.rows).contiguous(), "feature_offsets": offsets}


class ShardWriter:
    """Accumulates whole sequences' rows and writes a shard past `max_rows` rows."""

    def __init__(
        self,
        root: Path,
        split: str,
        max_rows: int,
        value_dtype: torch.dtype,
        features: ShardFeatures | None = None,
    ):
        self.root, self.split, self.max_rows, self.dtype = root, split, max_rows, value_dtype
        self.features = features  # the batches' hidden states, shard by shard (or None)
        self.shards: list[dict] = []
        self.next_sequence = 0
        self._reset()

    def _reset(self) -> None:
        self.indices, self.values, self.rest, self.counts = [], [], [], []
        self.rows = 0
        if self.features is not None:
            self.features.reset()

    def add(self, indices, values, rest, counts, features=None, attention_mask=None) -> None:
        """One batch's rows (`counts` [B] per item); with `features` [B, T, F], its items'
        hidden states at the attended positions of `attention_mask` [B, T] too."""
        start = 0
        for b, n in enumerate(counts.tolist()):
            if self.features is not None:
                self.features.add(features[b], attention_mask[b])
            self.indices.append(indices[start : start + n].to(torch.int32).cpu())
            self.values.append(values[start : start + n].to(self.dtype).cpu())
            self.rest.append(rest[start : start + n].to(self.dtype).cpu())
            self.counts.append(n)
            self.rows += n
            start += n
            if self.rows >= self.max_rows:
                self.flush()

    def flush(self) -> None:
        if not self.counts:
            return

        name = f"{self.split}-{len(self.shards):06d}.safetensors"
        offsets = torch.zeros(len(self.counts) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(self.counts, dtype=torch.int64).cumsum(0)
        tensors = {
            "indices": torch.cat(self.indices).contiguous(),
            "logprobs": torch.cat(self.values).contiguous(),
            "rest": torch.cat(self.rest).contiguous(),
            "offsets": offsets,
        }
        if self.features is not None:
            tensors |= self.features.tensors()
        metadata = {
            "format": FORMAT,
            "split": self.split,
            "first_sequence": str(self.next_sequence),
            "sequences": str(len(self.counts)),
        }
        save_file(tensors, str(self.root / name), metadata=metadata)
        self.shards.append(
            {
                "file": name,
                "first_sequence": self.next_sequence,
                "sequences": len(self.counts),
                "rows": self.rows,
                "bytes": (self.root / name).stat().st_size,
            }
            | ({} if self.features is None else {"feature_rows": len(tensors["features"])})
        )
        self.next_sequence += len(self.counts)
        self._reset()
