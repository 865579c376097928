"""Raw records → token ids + loss mask. Nothing here knows about losses or models.

    train, eval = build_datasets(tokenizer, ["corpus/**/*.py", "chats.jsonl"], max_length=512)
    batch = collate([train[i] for i in range(8)], tokenizer.pad_token_id)

An item is {"input_ids": LongTensor[L], "loss_mask": BoolTensor[L]}; loss_mask[t] is True
when token t is a training target (predicted at position t-1), never at t=0. Sources are
described in data/sources.py, masking in data/tokenize.py, packing in data/dataset.py.
`dataset.stats` (DataStats) counts records, tokens and, with skip_malformed=True, the
malformed records skipped, by reason (`stats.skipped`).
"""

from specdistill.data.dataset import DataStats, TokenDataset, build_datasets, collate
from specdistill.data.records import DataError

__all__ = ["DataError", "DataStats", "TokenDataset", "build_datasets", "collate"]
