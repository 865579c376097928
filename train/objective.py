"""The draft's loss of one micro-batch, as the recipe's resolved loss asks
(`losses.resolved.ResolvedLoss`, resolved once by train/recipe_loss.py and never checked
again here): the per-token part (its parts on the target source's depths, direct or chunked)
and the accepted-length part (`tau`, on the draft's own chains: drafts/chains.py,
losses/tau.py), each summed over the served-sampling shares (train/temperatures.py).

Every part is a sum over valid positions, divided by the step once: the chain part's Σ over
chains is scaled by (valid positions / chains) of its share, an unbiased estimate of its sum
had every valid position started a chain. With no per-token part, the step's logged α is
the teacher-forced α at the chains' starts (their first position), scaled the same way.
"""

from dataclasses import asdict
from typing import NamedTuple

import torch
from torch import Tensor

from specdistill.drafts.align import target_mask
from specdistill.losses.chunked import chunked_sums
from specdistill.losses.multi_depth import aligned_depths, depth_sums
from specdistill.losses.resolved import ResolvedLoss, Sampling, TokenLoss
from specdistill.losses.tau import chunked_tau_loss, tau_loss
from specdistill.train.forward import Hidden, Outputs
from specdistill.train.temperatures import Share


class Sums(NamedTuple):
    """A micro-batch's Σ loss (with its graph) and detached Σ α at depth 0."""

    loss_sum: Tensor
    alpha_sum: Tensor


class Objective:
    """A resolved loss evaluated on micro-batches, its per-token and chain parts."""

    def __init__(self, loss: ResolvedLoss, seed: int = 0):
        self.loss, self.seed = loss, seed

    @property
    def token(self) -> TokenLoss | None:
        """The per-token part (None: the loss is the chain part alone)."""
        return self.loss.token

    @property
    def chains(self) -> bool:
        """Whether the loss samples the draft's own chains (a chain part of weight > 0)."""
        return self.loss.chain is not None and self.loss.chain.weight > 0

    def sampling(self, share: Share) -> Sampling:
        """The target's sampling filter of the loss at `share`'s served top-p."""
        return Sampling(**share.params(asdict(self.loss.sampling)))

    # --------------------------------------------------------------- per-token part
    def token_part(self, outputs: Outputs, shares: list[Share], d2t, labels=None) -> Sums:
        """The per-token loss on a micro-batch's forward (train/forward.py): per depth
        (`token_sums`; labels: its `positions`), or chunk by chunk (`chunked_token_sums`)."""
        if isinstance(outputs, Hidden):
            target = (outputs.target, outputs.target_head)
            return self.chunked_token_sums(
                outputs.draft, outputs.draft_head, target, outputs.mask, shares, outputs.chunk_size
            )
        return self.token_sums(outputs.depths, shares, d2t, labels)

    def token_sums(self, depths, shares: list[Share], d2t, positions: list | None = None) -> Sums:
        """The per-token loss on teacher-forced depths (d_logits, t_logits, masks).

        positions: with one share, a list that receives α at every position per depth
        (`losses.multi_depth.depth_sums`), e.g. an acceptance head's labels."""
        d_logits, t_logits, masks = depths
        loss_sum = alpha_sum = 0.0
        if positions is not None and len(shares) != 1:
            raise ValueError("per-position α is given for a single share only")
        for share in shares:
            aligned = aligned_depths(d_logits, t_logits, [share.mask(m) for m in masks])
            loss, n_valid, alpha = depth_sums(
                self.loss.token,
                aligned,
                self.loss.depths,
                share.loss_temperature,
                self.sampling(share),
                d2t,
                positions,
            )
            loss_sum = loss_sum + share.weight * loss
            alpha_sum = alpha_sum + share.weight * alpha[0] * n_valid
        return Sums(loss_sum, alpha_sum)

    def chunked_token_sums(
        self, d_hidden, d_head, target, mask, shares: list[Share], chunk_size: int
    ) -> Sums:
        """The per-token loss from hidden states, chunk by chunk (losses/chunked.py)."""
        loss_sum = alpha_sum = 0.0
        for share in shares:
            loss, _, alpha = chunked_sums(
                self.loss.token,
                d_hidden,
                d_head,
                target,
                share.mask(mask),
                chunk_size=chunk_size,
                temperature=share.loss_temperature,
                sampling=self.sampling(share),
                d2t=None,
                return_alpha=True,
            )
            loss_sum = loss_sum + share.weight * loss
            alpha_sum = alpha_sum + share.weight * alpha
        return Sums(loss_sum, alpha_sum)

    # ------------------------------------------------------------------ chain part
    def chain_sums(self, core, batch: dict, shares: list[Share], call: int) -> Sums:
        """The accepted-length loss of the draft's own chains, every share's."""
        valid = target_mask(batch)
        chunk = core.loss_cfg.chunk_size
        heads = core.heads() if chunk is not None else None
        chain = self.loss.chain
        loss_sum = alpha_sum = 0.0
        for i, share in enumerate(shares):
            rows = share.mask(valid)
            columns = rows.any(0).nonzero()[:, 0]
            if len(columns) == 0:
                continue
            g = torch.Generator().manual_seed(
                (self.seed * 1_000_003 + core.step) * 1_009 + call * 31 + i
            )
            pick = torch.randperm(len(columns), generator=g)[: chain.prefixes]
            starts = sorted(int(columns[j]) for j in pick)
            device_seed = int(torch.randint(2**62, (1,), generator=g))
            chains = core.kind.chains(
                core.draft,
                core.target,
                batch,
                starts,
                gamma=chain.gamma,
                temperature=share.loss_temperature,
                generator=torch.Generator(device=valid.device).manual_seed(device_seed),
                hidden=heads is not None,
            )
            chain_rows = share.mask(torch.ones_like(valid[:, 0])).repeat(len(starts))
            sums = self._tau_sums(core, chains, chains.mask & chain_rows, share, heads)
            scale = rows.sum() / sums.n_chains.clamp_min(1)
            loss_sum = loss_sum + share.weight * chain.weight * scale * sums.loss_sum
            alpha_sum = alpha_sum + share.weight * scale * sums.alpha_sum
        return Sums(loss_sum, alpha_sum)

    def _tau_sums(self, core, chains, mask, share: Share, heads):
        """`losses.tau` on a share's chains: from their logits, or chunk by chunk from their
        hidden states and the output heads (`heads`: target's, draft's)."""
        sampling = self.sampling(share)
        common = {
            "temperature": share.loss_temperature,
            "estimator": self.loss.chain.estimator,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
        }
        if heads is None:
            return tau_loss(
                chains.draft, chains.target, chains.tokens, mask, d2t=core.vocab_map(), **common
            )
        t_head, d_head = heads
        return chunked_tau_loss(
            chains.draft,
            d_head,
            (chains.target, t_head),
            chains.tokens,
            mask,
            chunk_size=core.loss_cfg.chunk_size,
            **common,
        )

    def sums(self, core, batch: dict, shares: list[Share], token: Sums | None, call: int) -> Sums:
        """The micro-batch's total: the per-token sums (None: no per-token part) plus the
        chain part; α from the per-token part when there is one, else from the chains."""
        if not self.chains:
            return token
        chain = self.chain_sums(core, batch, shares, call)
        if token is None:
            return Sums(_tensor(chain.loss_sum, batch), _tensor(chain.alpha_sum, batch).detach())
        return Sums(token.loss_sum + chain.loss_sum, token.alpha_sum)


def _tensor(value, batch: dict) -> Tensor:
    if isinstance(value, Tensor):
        return value
    return torch.zeros((), device=batch["input_ids"].device)
