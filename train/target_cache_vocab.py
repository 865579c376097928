"""The target cache over a draft's own columns: `specdistill cache --columns draft`.

A draft over a reduced vocabulary (`draft.vocab_size`, drafts/standalone/reduced_vocab.py)
compares its K columns with the target's log-probabilities of the same K tokens, taken from the
softmax over the whole vocabulary (they sum to the target's mass on V_d). Stored once per valid
position, those K values are all that its losses, α and acceptance-head labels read
(`losses.VocabTarget`): training then runs no target forward and no softmax over the
target's vocabulary, and gives the live target's losses and gradients (tests/train/test_cache.py).

A shard holds `logprobs [R, K]` in the draft's column order (float16 by default), `rest [R]`
(the mass off V_d, for the summary), `indices [R, 0]` and the offsets, as the top-N cache
lays them out (train/target_cache.py); the manifest records `columns: draft` and the K target
ids, which must be the draft's own (`check_draft_ids`).
"""

import json
from pathlib import Path

import torch

from specdistill.drafts.align import shifted_logits, target_mask
from specdistill.losses import VocabTarget
from specdistill.train.target_cache_shards import rest_mass

COLUMNS = ("top-n", "draft")


def columns_for(capabilities, top_n: int | None = None) -> str:
    """The columns a cache for a draft type of these `Capabilities` holds, as `specdistill
    prepare` builds it: top-N when it keeps the top `top_n` while answering
    (`prepare.top_n`), else the draft's own for a draft over a reduced vocabulary, else
    top-N."""
    return "draft" if capabilities.vocab_targets and top_n is None else "top-n"


def cache_columns(path) -> str | None:
    """The columns a cache directory was built with ("top-n" for caches that do not say), or
    None when its manifest cannot be read (the cache's own checks then say why)."""
    try:
        manifest = json.loads((Path(path) / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return manifest.get("columns", "top-n") if isinstance(manifest, dict) else None


@torch.no_grad()
def vocab_rows(target, batch: dict, vocab_size: int, ids: torch.Tensor):
    """(indices [R, 0], logprobs [R, K] fp32, rest [R] fp32, rows per item [B]) of one collated
    batch: the target's log-softmax over `vocab_size` columns at each valid position, at the K
    ids `ids`, items in order, positions in order."""
    return vocab_rows_of(shifted_logits(target, batch, vocab_size), batch, ids)


@torch.no_grad()
def head_logits(target, final: torch.Tensor) -> torch.Tensor:
    """The target's logits from its last decoder layer's output before the final norm
    (`final` [..., H]): its final norm, then its output head, in float32."""
    norm = target.get_decoder().norm
    head = target.get_output_embeddings()
    return head(norm(final.to(head.weight.dtype))).float()


@torch.no_grad()
def vocab_rows_of(logits: torch.Tensor, batch: dict, ids: torch.Tensor):
    """`vocab_rows` from the shifted logits [B, L−1, V] given."""
    mask = target_mask(batch)
    logp = logits[mask].float().log_softmax(-1).index_select(-1, ids.to(logits.device))
    return logp.new_zeros((len(logp), 0), dtype=torch.long), logp, rest_mass(logp), mask.sum(1)


def place_rows(mask: torch.Tensor, width: int, rows: list, mismatch) -> torch.Tensor:
    """[B, L, width] float32 from per-item rows [n, width]: item b's rows go to the True
    positions of mask[b] [B, L], in order; the others hold 0. An item whose n differs from
    its number of True positions raises `mismatch(b, n, valid)`."""
    out = torch.zeros(*mask.shape, width, device=mask.device)
    for b, values in enumerate(rows):
        where = mask[b].nonzero().squeeze(-1)
        if len(where) != len(values):
            raise mismatch(b, len(values), len(where))
        out[b, where] = values.to(out.dtype).to(mask.device)
    return out


def place_vocab_rows(mask: torch.Tensor, width: int, rows: list, mismatch):
    """A `losses.VocabTarget` [B, L−1, K] from per-item rows [n, K] at the valid positions of
    mask [B, L−1] (`place_rows`)."""
    return VocabTarget(place_rows(mask, width, rows, mismatch))


def draft_ids_problem(stored: list[int], ids: torch.Tensor) -> str | None:
    """Why a cache stored over `stored` target ids cannot serve a draft whose K columns are
    `ids`; None when they are the same ids in the same order."""
    ours = ids.tolist()
    if stored == ours:
        return None
    if len(stored) != len(ours):
        return f"was built over {len(stored)} draft columns, this draft has {len(ours)}"
    first = next(i for i, (a, b) in enumerate(zip(stored, ours, strict=True)) if a != b)
    return (
        f"was built for another draft vocabulary (column {first}: token {stored[first]}, this "
        f"draft's {ours[first]}; the training data or draft.vocab_size differ)"
    )
