"""Attention of a few query rows over a cache (a decoding step, a verification pass) as two
batched matrix products, for the lean forward (models/lean.py).

PyTorch's CPU `scaled_dot_product_attention` is written for blocks of queries: with one or a
few query rows per sequence and a key mask (a batch whose rows hold different lengths), its
flash kernel costs several times the arithmetic. On SmolLM2-135M's shape (9 query heads over
3 KV heads, head size 64), 32 rows of one query over about 280 keys took 3.2-3.6 ms a layer in
it, about as long as the layer's four matrix products (benchmarks/RESULTS.md, "Attention of
a few rows as matrix products").

Here the query heads that share a KV head are stacked as rows of one product, so the keys
and values are read once per KV head and never repeated: scores [B, KV, G·k, L] = q Kᵀ, the
additive key mask, softmax, then the product with V. The result equals SDPA's to float
rounding (tests/models/test_attention.py). The lean forward takes it for batches of more than
one sequence in float32: for one sequence SDPA measured 1-2 ms a forward faster, and
half-precision inputs keep SDPA, which accumulates the softmax in float32.
"""

import torch

ATTENTION_ROWS = 16  # query rows per sequence up to which `few_rows_attention` applies
MIN_BATCH = 2  # sequences from which it applies: one sequence keeps SDPA (faster there)


def applies(batch: int, rows: int, causal: bool, dtype: torch.dtype) -> bool:
    """Whether the lean forward's attention of `batch` sequences of `rows` new tokens each
    takes `few_rows_attention`: float32, no causal block (not a prefill), at least
    MIN_BATCH sequences of at most ATTENTION_ROWS rows."""
    return not causal and dtype == torch.float32 and batch >= MIN_BATCH and rows <= ATTENTION_ROWS


def few_rows_attention(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """q [B, H, k, d] over key, value [B, KV, L, d] (H a multiple of KV: query head h reads
    KV head h // (H / KV)); mask: additive [B, 1, k, L] or None (every key visible to every
    row) -> [B, H, k, d]."""
    b, heads, k, d = q.shape
    kv, length = key.shape[1], key.shape[2]
    group = heads // kv
    rows = q.reshape(b, kv, group * k, d)
    scores = torch.matmul(rows, key.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores = scores.view(b, kv, group, k, length).add_(mask[:, :, None])
        scores = scores.view(b, kv, group * k, length)
    return torch.matmul(torch.softmax(scores, dim=-1), value).view(b, heads, k, d)
