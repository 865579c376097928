"""An EAGLE-3 head's own γ-token chains, for the accepted-length objective (losses/tau.py).

The head's training-time test already drafts from every position at once; here its steps
≥ 1 are fed the tokens it sampled itself (`Eagle3Head.unroll(next_ids=...)`) instead of the
text's. The chain from start t (the prefix input_ids[:, :t+1], as for a standalone draft) is
the unroll's entry t − 1: it reads the target's features at t − 1 and token t, so its first
position predicts token t + 1. The target scores the chains in one forward of the tree of
drafts/chains.py. Chain tokens are draft-vocabulary indices; `d2t` maps them to the target's.
"""

import torch
from torch import Tensor

from specdistill.drafts.align import target_mask
from specdistill.drafts.chains import Chains, Tree, by_chain, check_maskable, tree_forward
from specdistill.errors import UserError


def sample_head_chains(
    head,
    target,
    features: Tensor,
    batch: dict,
    starts: list[int],
    *,
    gamma: int,
    temperature: float,
    vocab_size: int,
    d2t: Tensor,
    generator: torch.Generator | None = None,
    hidden: bool = False,
) -> Chains:
    """The chains of a batch from each start in `starts` (module docstring): `head` the
    (possibly wrapped) Eagle3Head, `features` the target's [B, T, n_aux·H_t] of the text."""
    if hidden:
        raise UserError(
            "loss tau with draft.type=eagle3 runs unchunked (the head's vocabulary is already "
            "the reduced one): set loss.chunk_size=null"
        )
    check_maskable(target)
    ids, attention = batch["input_ids"], batch["attention_mask"]
    tree = Tree.of(starts, attention)
    entries = (tree.starts - 1).clamp_min(0)
    b, s = ids.shape[0], len(tree.starts)
    sampled: list[Tensor] = []

    def sample(step: int, logits: Tensor) -> Tensor:
        probs = (logits.float() / temperature).softmax(-1)
        token = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
        sampled.append(token.reshape(logits.shape[:2]))
        return sampled[-1] + d2t[sampled[-1]]

    def replay(step: int, logits: Tensor) -> Tensor:
        return sampled[step - 1] + d2t[sampled[step - 1]]

    run = {"input_ids": ids, "attention_mask": attention, "features": features}
    with torch.no_grad():
        head(**run, ttt_steps=gamma, next_ids=sample)
    logits = head(**run, ttt_steps=gamma, next_ids=replay)
    draft = torch.stack([step[:, entries] for step in logits], 1)  # [B, γ, S, V_d]
    draft = draft.permute(2, 0, 1, 3).reshape(s * b, gamma, -1)
    own = torch.stack([step[:, entries] for step in sampled[: gamma - 1]], 1)  # [B, γ−1, S]
    blocks = (own + d2t[own]).reshape(b, -1)
    with torch.no_grad():
        t_out = tree_forward(target, ids[:, : tree.length], blocks, tree, gamma - 1, hidden=False)
    tokens = own.permute(2, 0, 1).reshape(s * b, gamma - 1)
    mask = (target_mask(batch)[:, tree.starts] & (tree.starts >= 1)[None]).T.reshape(-1)
    return Chains(draft, by_chain(t_out[..., :vocab_size], gamma, s), tokens, mask)
