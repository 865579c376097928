"""Attention of a few query rows as two matrix products (models/attention.py) equals PyTorch's
scaled_dot_product_attention, with and without a key mask, for grouped and plain heads."""

import pytest
import torch
import torch.nn.functional as F

from specdistill.models.attention import ATTENTION_ROWS, few_rows_attention
from specdistill.models.lean import additive_mask


def inputs(b: int, heads: int, kv: int, k: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, k, 64, generator=g)
    key = torch.randn(b, kv, length, 64, generator=g)
    value = torch.randn(b, kv, length, 64, generator=g)
    return q, key, value


@pytest.mark.parametrize("heads,kv", [(9, 3), (4, 4), (8, 2)])
@pytest.mark.parametrize("k", [1, 4, ATTENTION_ROWS])
def test_equals_sdpa_with_a_key_mask(heads, kv, k):
    b, length = 3, 40
    q, key, value = inputs(b, heads, kv, k, length)
    keys = torch.ones(b, length, dtype=torch.bool)
    keys[0, :7] = False  # left padding
    keys[1, 20:25] = False  # holes of rejected drafts
    mask = additive_mask(keys, k, torch.float32)
    expected = F.scaled_dot_product_attention(
        q, key, value, attn_mask=mask, scale=0.125, enable_gqa=heads != kv
    )
    got = few_rows_attention(q, key, value, mask, 0.125)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_equals_sdpa_without_a_mask():
    q, key, value = inputs(2, 9, 3, 1, 33, seed=1)
    expected = F.scaled_dot_product_attention(q, key, value, scale=0.2, enable_gqa=True)
    torch.testing.assert_close(
        few_rows_attention(q, key, value, None, 0.2), expected, atol=1e-5, rtol=1e-5
    )


def test_a_masked_key_is_not_read():
    q, key, value = inputs(1, 9, 3, 2, 10, seed=2)
    keys = torch.ones(1, 10, dtype=torch.bool)
    keys[0, 3] = False
    mask = additive_mask(keys, 2, torch.float32)
    before = few_rows_attention(q, key, value, mask, 0.125)
    value[0, :, 3] = 1e6
    key[0, :, 3] = 1e3
    torch.testing.assert_close(few_rows_attention(q, key, value, mask, 0.125), before)
