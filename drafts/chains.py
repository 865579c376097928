"""The draft's own γ-token chains from prefixes of the training text, for the accepted-length
objective (losses/tau.py): a standalone draft samples a_1 … a_{γ−1} at the serving
temperature (batched, on its KV cache, without gradients), then one forward of the draft
(with gradients) and one of the target score every chain position.

Chains start at `starts`, positions t of the batch shared by every row: the prefix of row b
is input_ids[b, :t+1], so chain position 1 is the teacher-forced prediction at t and the
chain counts where token t+1 is a training target (`target_mask`).
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from specdistill.drafts.align import target_mask
from specdistill.drafts.kv_cache import cache_keyword


@dataclass
class Chains:
    """N chains of γ positions: ``draft`` and ``target`` [N, γ, V] logits (or [N, γ, H]
    final hidden states, for a chunked loss), ``tokens`` [N, γ−1] the draft's samples,
    ``mask`` [N] bool (rows in start order: start 0's B rows, then start 1's, ...)."""

    draft: Tensor
    target: Tensor
    tokens: Tensor
    mask: Tensor


def sample_chains(
    draft,
    target,
    batch: dict,
    starts: list[int],
    *,
    gamma: int,
    temperature: float,
    vocab_size: int,
    generator: torch.Generator | None = None,
    hidden: bool = False,
) -> Chains:
    """The chains of a batch from each start in `starts` (module docstring); `temperature`
    > 0, the draft sampled unfiltered (softmax(logits / T)), as the engine's drafter does."""
    ids, attention = batch["input_ids"], batch["attention_mask"]
    valid = target_mask(batch)
    parts = []
    for t in starts:
        prefix, prefix_mask = ids[:, : t + 1], attention[:, : t + 1]
        tokens = _sample(draft, prefix, prefix_mask, gamma - 1, temperature, vocab_size, generator)
        seq = torch.cat([prefix, tokens], 1)
        seq_mask = torch.cat([prefix_mask, torch.ones_like(tokens, dtype=prefix_mask.dtype)], 1)
        d = _last(draft, seq, seq_mask, gamma, vocab_size, hidden)
        with torch.no_grad():
            t_out = _last(target, seq, seq_mask, gamma, vocab_size, hidden)
        parts.append((d, t_out, tokens, valid[:, t]))
    d, t_out, tokens, mask = (torch.cat(p) for p in zip(*parts, strict=True))
    return Chains(d, t_out, tokens, mask)


@torch.no_grad()
def _sample(model, prefix, prefix_mask, n: int, temperature, vocab_size, generator) -> Tensor:
    """n tokens per row sampled from the model after `prefix`, on its KV cache: [B, n]."""
    if n == 0:
        return prefix.new_zeros(prefix.shape[0], 0)
    model = getattr(model, "module", model)  # the bare model under a DDP wrapper
    cache = cache_keyword(model)
    out = model(input_ids=prefix, attention_mask=prefix_mask, use_cache=True, logits_to_keep=1)
    mask, tokens = prefix_mask, []
    for k in range(n):
        logits = out.logits[:, -1, :vocab_size].float() / temperature
        token = torch.multinomial(logits.softmax(-1), 1, generator=generator)
        tokens.append(token)
        if k < n - 1:
            mask = torch.cat([mask, torch.ones_like(token, dtype=mask.dtype)], 1)
            out = model(
                input_ids=token,
                attention_mask=mask,
                use_cache=True,
                **{cache: out.past_key_values},
            )
    return torch.cat(tokens, 1)


def _last(model, seq, seq_mask, gamma: int, vocab_size: int, hidden: bool) -> Tensor:
    """The model's logits (or final hidden states) at the last γ positions of `seq`."""
    if hidden:
        out = model(
            input_ids=seq, attention_mask=seq_mask, output_hidden_states=True, logits_to_keep=1
        )
        return out.hidden_states[-1][:, -gamma:]
    out = model(input_ids=seq, attention_mask=seq_mask, logits_to_keep=gamma)
    return out.logits[:, -gamma:, :vocab_size]
