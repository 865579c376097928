"""The one sampling filter of the project: temperature, then top-k, then top-p.

Used by the losses (`target_logp`), the offline α and the speculative decoding engine alike,
so the α a loss optimises, the offline α and the engine's measured acceptance are one number
(docs/theory.md §1). It filters the *target's* distribution p only: the draft's q is
softmax(draft_logits / T), unfiltered, in training, offline and in the engine.

"Off" is `None` for both filters; top_p = 1.0 also keeps every token (as a value), and top_k,
when given, must be >= 1. Temperature must be > 0: greedy decoding (T = 0) is argmax, which
callers handle themselves.
"""

import torch
from torch import Tensor

from specdistill.losses.declaration import TOP_K, TOP_P


def check_filters(top_p: float | None, top_k: int | None) -> None:
    """ValueError unless top_p and top_k are None or within their declared bounds
    (`losses.declaration.SETTINGS`: top_p in (0, 1], top_k >= 1)."""
    TOP_P.check(top_p, "top_p")
    TOP_K.check(top_k, "top_k")


def filter_logits(
    logits: Tensor, temperature: float, top_p: float | None = None, top_k: int | None = None
) -> Tensor:
    """Temperature-scaled logits with the filtered entries at −inf: [..., V] -> [..., V].

    Computed in fp32 (fp64 stays fp64). Order as in vLLM / HF samplers: temperature, then
    top-k (the k largest logits), then top-p (the smallest set of tokens, in decreasing
    probability, whose mass reaches `top_p`; the most probable token is always kept).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to filter, got {temperature} (0 is argmax)")
    check_filters(top_p, top_k)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # mass before >= top_p
        drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def probabilities(
    logits: Tensor, temperature: float, top_p: float | None = None, top_k: int | None = None
) -> Tensor:
    """The sampling distribution: softmax of `filter_logits`, [..., V] -> [..., V] (fp32)."""
    return filter_logits(logits, temperature, top_p, top_k).softmax(-1)
