"""Token datasets: records → fixed-size training sequences, and the batch collator.

A dataset item is {"input_ids": LongTensor[L], "loss_mask": BoolTensor[L]} with
L <= max_length. loss_mask[t] is True when token t is a training target, i.e. the
distributions at position t-1 are compared on it. loss_mask[0] is always False: nothing
precedes the first token, so it cannot be a target. Sequences without any target are
dropped, so every item trains on something.

pack=True concatenates the records' tokens (in order, masks carried along) and cuts blocks
of exactly max_length; the last, shorter block is kept if it has at least 2 tokens. Blocks
cross document boundaries (text documents end in EOS); attention is not reset at them.
pack=False gives one sequence per record, truncated to max_length.
"""

import logging
import random
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from specdistill.data.records import DataError, Record
from specdistill.data.sources import read_records
from specdistill.data.tokenize import Tokens, tokenize_records
from specdistill.errors import UserError

logger = logging.getLogger(__name__)

MIN_BLOCK = 2  # a sequence needs two tokens to hold one prediction


@dataclass
class DataStats:
    n_records: int  # well-formed records in this split (before dropping any without targets)
    n_skipped: int  # malformed records skipped (skip_malformed=True)
    skipped: dict[str, int]  # the same by reason (DataError.reason), most frequent first
    n_sequences: int
    n_tokens: int
    n_loss_tokens: int


class TokenDataset(torch.utils.data.Dataset):
    """Sequences stored flat: ids [N] int32, mask [N] bool, offsets [n_sequences + 1]."""

    def __init__(self, sequences: list[Tokens], *, n_records: int, skipped: dict[str, int]):
        lengths = np.array([len(s.ids) for s in sequences], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(lengths)])
        empty = np.zeros(0, dtype=np.int32)
        self._ids = torch.from_numpy(np.concatenate([empty, *(s.ids for s in sequences)]))
        self._mask = torch.from_numpy(
            np.concatenate([empty.astype(bool), *(s.mask for s in sequences)])
        )
        self.stats = DataStats(
            n_records=n_records,
            n_skipped=sum(skipped.values()),
            skipped=dict(skipped),
            n_sequences=len(sequences),
            n_tokens=len(self._ids),
            n_loss_tokens=int(self._mask.sum()),
        )

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} sequences")
        i %= len(self)
        start, end = int(self._offsets[i]), int(self._offsets[i + 1])
        return {
            "input_ids": self._ids[start:end].long(),
            "loss_mask": self._mask[start:end].clone(),
        }


def build_datasets(
    tokenizer,
    train: str | list[str],
    eval: str | list[str] | None = None,
    *,
    max_length: int = 512,
    pack: bool = True,
    eval_fraction: float = 0.05,
    skip_malformed: bool = False,
    seed: int = 0,
) -> tuple[TokenDataset, TokenDataset]:
    """Read, tokenise and mask `train` and `eval` sources (see data/sources.py for the forms).

    eval=None holds out `eval_fraction` of the train *records* (before packing), chosen by
    `seed`, with at least one record on each side; eval_fraction is used only then.
    Malformed records raise DataError, or with skip_malformed=True are skipped, counted in
    stats.n_skipped and by reason in stats.skipped, and summarised in one warning per
    dataset, whether they failed at reading or at tokenising. Records skipped while reading
    the train sources count towards the train dataset even when the eval split is taken
    from them.
    """
    if max_length < MIN_BLOCK:
        raise UserError(f"max_length must be >= {MIN_BLOCK}, got {max_length}")
    if eval is None and not 0 < eval_fraction < 1:
        raise UserError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    train_sources = [train] if isinstance(train, str) else list(train)
    train_label = f"train data ({', '.join(train_sources)})"
    train_records, train_skipped = _read(train_sources, skip_malformed, train_label)
    if eval is None:
        eval_label = f"eval data (held-out {eval_fraction:g} of {', '.join(train_sources)})"
        train_records, eval_records = split_records(train_records, eval_fraction, seed, train_label)
        eval_skipped = []
    else:
        eval_sources = [eval] if isinstance(eval, str) else list(eval)
        eval_label = f"eval data ({', '.join(eval_sources)})"
        eval_records, eval_skipped = _read(eval_sources, skip_malformed, eval_label)
    common = dict(max_length=max_length, pack=pack, skip_malformed=skip_malformed)
    return (
        _build(tokenizer, train_records, train_skipped, label=train_label, **common),
        _build(tokenizer, eval_records, eval_skipped, label=eval_label, **common),
    )


def split_records(
    records: list[Record], eval_fraction: float, seed: int, label: str
) -> tuple[list[Record], list[Record]]:
    """(train, eval): a seeded random `eval_fraction` of the records, each side in source order."""
    n = len(records)
    if n < 2:
        raise DataError(
            f"{label}: {n} record(s), too few to hold out an eval split; "
            "pass eval sources (data.eval) or more train data"
        )
    n_eval = min(n - 1, max(1, round(eval_fraction * n)))
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held_out = set(order[:n_eval])
    return (
        [r for i, r in enumerate(records) if i not in held_out],
        [r for i, r in enumerate(records) if i in held_out],
    )


def collate(batch: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad items to the longest one.

    Returns input_ids [B, L] long (pad_token_id on padding), attention_mask [B, L] long
    (1 on tokens, 0 on padding), loss_mask [B, L] bool (False on padding).
    """
    if not batch:
        raise ValueError("collate needs at least one item")
    if pad_token_id is None:
        raise UserError("pad_token_id is None; set tokenizer.pad_token (e.g. to its eos_token)")
    length = max(len(item["input_ids"]) for item in batch)
    input_ids = torch.full((len(batch), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), length), dtype=torch.long)
    loss_mask = torch.zeros((len(batch), length), dtype=torch.bool)
    for row, item in enumerate(batch):
        n = len(item["input_ids"])
        input_ids[row, :n] = item["input_ids"]
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = item["loss_mask"]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def _keep_valid(items, skip_malformed: bool) -> tuple[list, list[DataError]]:
    """Split a reader's output (results and `DataError`s) into (results, skipped errors).

    The first error is raised unless `skip_malformed`.
    """
    valid, malformed = [], []
    for item in items:
        if isinstance(item, DataError):
            if not skip_malformed:
                raise item
            malformed.append(item)
        else:
            valid.append(item)
    return valid, malformed


def _read(
    sources: list[str], skip_malformed: bool, label: str
) -> tuple[list[Record], list[DataError]]:
    records, malformed = _keep_valid(read_records(sources), skip_malformed)
    if not records:
        _warn_skipped(malformed, label)
        raise DataError(f"{label}: no records (empty files and empty texts are ignored)")
    return records, malformed


def _build(
    tokenizer,
    records: list[Record],
    skipped: list[DataError],
    *,
    max_length: int,
    pack: bool,
    skip_malformed: bool,
    label: str,
) -> TokenDataset:
    tokenized, malformed = _keep_valid(tokenize_records(tokenizer, records), skip_malformed)
    skipped = [*skipped, *malformed]
    _warn_skipped(skipped, label)
    without_targets = sum(not t.mask.any() for t in tokenized)
    if without_targets:
        logger.warning(
            "%s: %d of %d records have no loss tokens (chat without assistant messages) and "
            "add nothing",
            label,
            without_targets,
            len(tokenized),
        )
    tokenized = [t for t in tokenized if t.mask.any()]
    sequences = (
        _pack(tokenized, max_length)
        if pack
        else [Tokens(t.ids[:max_length], t.mask[:max_length]) for t in tokenized]
    )
    for s in sequences:
        s.mask[0] = False
    sequences = [s for s in sequences if len(s.ids) >= MIN_BLOCK and s.mask.any()]
    dataset = TokenDataset(
        sequences, n_records=len(records) - len(malformed), skipped=_by_reason(skipped)
    )
    if dataset.stats.n_loss_tokens == 0:
        raise DataError(
            f"no loss tokens after masking: {label} ({dataset.stats.n_records} records). "
            "Chat records train only on assistant messages, so each needs at least one "
            f"(within max_length={max_length} when pack=False)."
        )
    logger.info("%s: %s", label, dataset.stats)
    return dataset


def _pack(tokenized: list[Tokens], max_length: int) -> list[Tokens]:
    empty = np.zeros(0, dtype=np.int32)
    ids = np.concatenate([empty, *(t.ids for t in tokenized)])
    mask = np.concatenate([empty.astype(bool), *(t.mask for t in tokenized)])
    return [
        Tokens(ids[start : start + max_length], mask[start : start + max_length])
        for start in range(0, len(ids), max_length)
    ]


def _by_reason(errors: list[DataError]) -> dict[str, int]:
    """Number of errors per reason, most frequent first."""
    return dict(Counter(error.reason for error in errors).most_common())


def _warn_skipped(malformed: list[DataError], label: str) -> None:
    """One warning for all of a dataset's skipped records: the total, by reason, one example."""
    if malformed:
        reasons = ", ".join(f"{reason}: {n}" for reason, n in _by_reason(malformed).items())
        logger.warning(
            "%s: skipped %d malformed records (%s), e.g. %s",
            label,
            len(malformed),
            reasons,
            malformed[0],
        )
