"""The draft's own γ-token chains from prefixes of the training text, for the accepted-length
objective (losses/tau.py): a standalone draft samples a_1 … a_{γ−1} at the serving
temperature (without gradients), then one forward of the draft (with gradients) and one of
the target score every chain position.

Chains start at `starts`, positions t of the batch shared by every row: the prefix of row b
is input_ids[b, :t+1], so chain position 1 is the teacher-forced prediction at t and the
chain counts where token t+1 is a training target (`target_mask`).

Every start's chain rides in one sequence (a tree): the text up to the last start, then one
block per chain step holding that step's token of every chain, token k of the chain from t
at position t + k. A 4-D attention mask lets it see the text up to t and its own chain's
earlier tokens, nothing else, so each chain position gets exactly the logits the model gives
the sequence prefix + chain on its own (tests/drafts/test_chains.py). The cost is one
forward over (last start + 1) + (γ − 1) · starts tokens per model, whatever the number of
starts; sampling step k runs the draft over the first k blocks.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from specdistill.drafts.align import target_mask
from specdistill.errors import UserError

# attention implementations that take an arbitrary 4-D mask (flash attention does not)
MASKABLE = ("eager", "sdpa", None)


@dataclass
class Chains:
    """N chains of γ positions: ``draft`` and ``target`` [N, γ, V] logits (or [N, γ, H]
    final hidden states, for a chunked loss), ``tokens`` [N, γ−1] the draft's samples,
    ``mask`` [N] bool (rows in start order: start 0's B rows, then start 1's, ...)."""

    draft: Tensor
    target: Tensor
    tokens: Tensor
    mask: Tensor


@dataclass(frozen=True)
class Tree:
    """The layout of a batch's chains in one sequence: the text's first `length` tokens
    (`attention` its [B, length] padding mask), then one block of len(`starts`) tokens per
    chain step."""

    starts: Tensor  # [S] long, sorted
    attention: Tensor  # [B, length]

    @classmethod
    def of(cls, starts: list[int], attention: Tensor) -> "Tree":
        """The tree of a batch's chains from `starts` (any order): its text runs through the
        last start."""
        ordered = torch.tensor(sorted(starts), device=attention.device)
        return cls(ordered, attention[:, : int(ordered[-1]) + 1])

    @property
    def length(self) -> int:
        return self.attention.shape[1]

    def positions(self, blocks: int) -> Tensor:
        """[1, length + blocks·S] position ids: the text's, then t + k for step k's tokens."""
        text = torch.arange(self.length, device=self.starts.device)
        steps = [self.starts + k for k in range(1, blocks + 1)]
        return torch.cat([text, *steps]).unsqueeze(0)

    def mask(self, blocks: int, dtype: torch.dtype) -> Tensor:
        """[B, 1, T, T] additive mask (0 where a query may attend, the dtype's minimum
        elsewhere) for the text and `blocks` chain steps, T = length + blocks·S."""
        n, s, dev = self.length, len(self.starts), self.starts.device
        total = n + blocks * s
        # where each token stands on the text (its own index for the text; t for a chain
        # token) and which chain it belongs to (-1 for the text)
        text_index = torch.arange(n, device=dev)
        anchor = torch.cat([text_index, self.starts.repeat(blocks)])
        chain = torch.cat(
            [torch.full((n,), -1, device=dev), torch.arange(s, device=dev).repeat(blocks)]
        )
        step = torch.cat(
            [
                torch.zeros(n, device=dev, dtype=torch.long),
                torch.arange(1, blocks + 1, device=dev).repeat_interleave(s),
            ]
        )
        key_is_text = chain == -1
        # a text key: causal on the text, and present (not padding)
        sees_text = key_is_text[None, :] & (anchor[None, :] <= anchor[:, None])
        sees_text = sees_text & (step[None, :] <= step[:, None])  # the text never sees chains
        # a chain key: the same chain, an earlier or the same step
        sees_chain = (chain[None, :] == chain[:, None]) & ~key_is_text[None, :]
        sees_chain = sees_chain & (step[None, :] <= step[:, None])
        allowed = sees_text | sees_chain  # [T, T]
        present = torch.cat(
            [
                self.attention.bool(),
                self.attention.new_ones(len(self.attention), blocks * s).bool(),
            ],
            1,
        )  # [B, T]
        allowed = allowed[None] & present[:, None, :]
        allowed = allowed | torch.eye(total, dtype=torch.bool, device=dev)[None]  # no empty row
        out = torch.zeros(allowed.shape, dtype=dtype, device=dev)
        return out.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)

    def keep(self, blocks: int) -> Tensor:
        """Indices of each chain step's input tokens: the starts, then every chain block
        but the last step's ([(blocks + 1)·S], step-major)."""
        chain = torch.arange(
            self.length, self.length + blocks * len(self.starts), device=self.starts.device
        )
        return torch.cat([self.starts, chain])


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
    for model in (draft, target):
        check_maskable(model)
    ids, attention = batch["input_ids"], batch["attention_mask"]
    tree = Tree.of(starts, attention)
    text = ids[:, : tree.length]
    b, s = text.shape[0], len(tree.starts)
    blocks = text.new_zeros(b, 0)
    with torch.no_grad():
        for k in range(gamma - 1):
            last = tree_forward(draft, text, blocks, tree, k, hidden=False)[:, -s:, :vocab_size]
            probs = (last.float() / temperature).softmax(-1).reshape(b * s, -1)
            token = torch.multinomial(probs, 1, generator=generator).reshape(b, s)
            blocks = torch.cat([blocks, token], 1)
        t_out = tree_forward(target, text, blocks, tree, gamma - 1, hidden)
    d_out = tree_forward(draft, text, blocks, tree, gamma - 1, hidden)
    if not hidden:
        d_out, t_out = d_out[..., :vocab_size], t_out[..., :vocab_size]
    tokens = blocks.reshape(b, gamma - 1, s).permute(2, 0, 1).reshape(s * b, gamma - 1)
    mask = target_mask(batch)[:, tree.starts].T.reshape(-1)
    return Chains(by_chain(d_out, gamma, s), by_chain(t_out, gamma, s), tokens, mask)


def prefix_groups(starts: list[int], rows: int) -> Tensor:
    """The prefix of each chain of `sample_chains` (start-major over the sorted `starts`,
    rows within a start): [len(starts) · rows] ids, equal for chains that share a row and a
    start (a start repeated in `starts` draws independent chains from one prefix)."""
    return (torch.tensor(sorted(starts))[:, None] * rows + torch.arange(rows)[None]).reshape(-1)


def check_maskable(model) -> None:
    """A model whose attention takes the tree's 4-D mask, or a UserError naming the fix."""
    config = getattr(getattr(model, "module", model), "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in MASKABLE:
        raise UserError(
            f"loss tau needs an attention implementation that takes a 4-D mask (eager or sdpa); "
            f"this model uses {impl!r}: set attn_implementation to sdpa for training"
        )


def tree_forward(model, text: Tensor, blocks: Tensor, tree: Tree, n_blocks: int, hidden: bool):
    """The model's logits (or final hidden states) at the inputs of chain steps 1..n_blocks+1:
    [B, (n_blocks + 1)·S, V or H], step-major."""
    seq = torch.cat([text, blocks], 1)
    dtype = _dtype(model)
    kwargs = {
        "input_ids": seq,
        "attention_mask": tree.mask(n_blocks, dtype),
        "position_ids": tree.positions(n_blocks),
    }
    keep = tree.keep(n_blocks)
    if hidden:
        out = model(**kwargs, output_hidden_states=True, logits_to_keep=1)
        return out.hidden_states[-1][:, keep]
    return model(**kwargs, logits_to_keep=keep).logits


def _dtype(model) -> torch.dtype:
    """The dtype of the model's floating parameters (the mask is added to its scores)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def by_chain(out: Tensor, gamma: int, s: int) -> Tensor:
    """[B, γ·S, X] step-major → [S·B, γ, X] in start order."""
    b = out.shape[0]
    return out.reshape(b, gamma, s, -1).permute(2, 0, 1, 3).reshape(s * b, gamma, -1)
