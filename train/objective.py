"""The draft's loss of one micro-batch, as the recipe's `loss` section asks: the per-token
part (a loss of the loss library on the target source's depths, direct or chunked) and the
accepted-length part (`tau`, on the draft's own chains: drafts/chains.py, losses/tau.py),
each summed over the served-sampling shares (train/temperatures.py).

`loss.name: tau` is the chain part alone; `loss.name: mix` with a `tau` part mixes it with
the other parts' per-token loss. Every part is a sum over valid positions, divided by the
step once: the chain part's Σ over chains is scaled by (valid positions / chains) of its
share, an unbiased estimate of its sum had every valid position started a chain. With no
per-token part, the step's logged α is the teacher-forced α at the chains' starts (their
first position), scaled the same way.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from specdistill import losses
from specdistill.drafts.align import target_mask
from specdistill.losses.divergences import params_of
from specdistill.losses.tau import chunked_tau_loss, tau_loss
from specdistill.train.temperatures import Share

TAU = "tau"


class Sums(NamedTuple):
    """A micro-batch's Σ loss (with its graph) and detached Σ α at depth 0."""

    loss_sum: Tensor
    alpha_sum: Tensor


class Objective:
    """The recipe's loss split into its per-token and chain parts."""

    def __init__(self, recipe, seed: int = 0):
        lo = recipe.loss
        params = dict(lo.params)
        self.tau_weight = 0.0
        self.token: tuple[str, dict] | None = (lo.name, params)
        if lo.name == TAU or (lo.name == "mix" and TAU in params["parts"]):
            own = params_of(TAU, params)
            rest = {k: v for k, v in params.items() if k not in own}
            if lo.name == TAU:
                self.tau_weight, self.token = 1.0, None
            else:
                parts = dict(rest.pop("parts"))
                self.tau_weight = parts.pop(TAU)
                self.token = ("mix", {**rest, "parts": parts}) if parts else None
            sampling = {k: rest[k] for k in ("top_p", "top_k") if k in rest}
            self.sampling = sampling
            self.gamma = own.get("gamma") or max(recipe.eval.speculative.gammas)
            self.prefixes = own.get("prefixes", 32)
            self.estimator = own.get("estimator", "score")
        self.seed = seed

    @property
    def chains(self) -> bool:
        return self.tau_weight > 0

    # --------------------------------------------------------------- per-token part
    def token_sums(self, lo, depths, shares: list[Share], d2t) -> Sums:
        """The per-token loss on teacher-forced depths (d_logits, t_logits, masks)."""
        name, params = self.token
        d_logits, t_logits, masks = depths
        loss_sum = alpha_sum = 0.0
        for share in shares:
            share_masks = [share.mask(m) for m in masks]
            loss, n_valid, alpha = losses.multi_depth_loss(
                name,
                d_logits,
                t_logits,
                share_masks,
                weighting=lo.depth_weighting,
                decay=lo.depth_decay,
                temperature=share.loss_temperature,
                d2t=d2t,
                **share.params(params),
            )
            loss_sum = loss_sum + share.weight * loss
            alpha_sum = alpha_sum + share.weight * alpha[0] * n_valid
        return Sums(loss_sum, alpha_sum)

    def chunked_token_sums(
        self, d_hidden, d_head, target, mask, shares: list[Share], chunk_size: int
    ) -> Sums:
        """The per-token loss from hidden states, chunk by chunk (losses/chunked.py)."""
        name, params = self.token
        loss_sum = alpha_sum = 0.0
        for share in shares:
            loss, _, alpha = losses.chunked_loss(
                name,
                d_hidden,
                d_head,
                target,
                share.mask(mask),
                chunk_size=chunk_size,
                temperature=share.loss_temperature,
                return_alpha=True,
                **share.params(params),
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
        loss_sum = alpha_sum = 0.0
        for i, share in enumerate(shares):
            rows = share.mask(valid)
            n_positions = rows.sum()
            columns = rows.any(0).nonzero()[:, 0]
            if len(columns) == 0:
                continue
            g = torch.Generator().manual_seed(
                (self.seed * 1_000_003 + core.step) * 1_009 + call * 31 + i
            )
            pick = torch.randperm(len(columns), generator=g)[: self.prefixes]
            starts = sorted(int(columns[j]) for j in pick)
            device_seed = int(torch.randint(2**62, (1,), generator=g))
            device_g = torch.Generator(device=valid.device).manual_seed(device_seed)
            chains = core.kind.chains(
                core.draft,
                core.target,
                batch,
                starts,
                gamma=self.gamma,
                temperature=share.loss_temperature,
                generator=device_g,
                hidden=heads is not None,
            )
            chain_rows = share.mask(torch.ones_like(valid[:, 0])).repeat(len(starts))
            mask = chains.mask & chain_rows
            sampling = share.params(self.sampling)
            if heads is None:
                sums = tau_loss(
                    chains.draft,
                    chains.target,
                    chains.tokens,
                    mask,
                    temperature=share.loss_temperature,
                    estimator=self.estimator,
                    d2t=core.vocab_map(),
                    **sampling,
                )
            else:
                t_head, d_head = heads
                sums = chunked_tau_loss(
                    chains.draft,
                    d_head,
                    (chains.target, t_head),
                    chains.tokens,
                    mask,
                    chunk_size=chunk,
                    temperature=share.loss_temperature,
                    estimator=self.estimator,
                    **sampling,
                )
            scale = n_positions / sums.n_chains.clamp_min(1)
            loss_sum = loss_sum + share.weight * self.tau_weight * scale * sums.loss_sum
            alpha_sum = alpha_sum + share.weight * scale * sums.alpha_sum
        return Sums(loss_sum, alpha_sum)

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
