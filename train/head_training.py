"""The acceptance head's side of a distillation step (drafts/acceptance_head.py).

`HeadTraining` holds the head, its own AdamW optimiser and learning-rate schedule (the
draft's warmup and cosine decay, at acceptance_head.lr or train.lr), and computes the head's
loss from the same depths (draft logits, target logits or sparse targets, masks) the step's
main loss reads. The label is α = Σ min(p, q) at eval.temperature, the serving temperature of
this project's recipes, under the loss's top_p / top_k (the verifier's filters).

The draft's optimiser never sees the head, so with acceptance_head.stop_gradient (the
default) the draft's update is bit-identical to a run without the head. The head is built
under a forked RNG seeded with train.seed: building it consumes none of the global random
state that the data order and the draft depend on. Its state (weights, optimiser, schedule)
goes into the run's checkpoints as one accelerate custom object. On more than one process
its gradients are averaged explicitly (it is not wrapped by DDP).
"""

from pathlib import Path

import torch
from accelerate import Accelerator

from specdistill.drafts.acceptance_head import (
    AcceptanceHead,
    AcceptanceHeadConfig,
    HeadInputs,
    HeadLoss,
    align_hidden,
    attach_head,
    attached_head,
    chunked_head_loss,
    has_acceptance_head,
    head_loss,
    load_acceptance_head,
)
from specdistill.losses.resolved import Sampling
from specdistill.train.forward import Hidden, Outputs
from specdistill.train.temperatures import Share


def saved_head(recipe, draft) -> AcceptanceHead | None:
    """The head the draft came with: the one it carries, else the one saved beside it when
    draft.model is a local directory with the head's files; None otherwise."""
    head = attached_head(draft)
    if head is not None:
        return head
    name = recipe.draft.model
    if name is None or not Path(name).expanduser().is_dir():
        return None
    path = Path(name).expanduser()
    if not has_acceptance_head(path):
        return None
    return load_acceptance_head(path, hidden_size=draft.config.hidden_size)


def build_head(recipe, draft) -> AcceptanceHead:
    """The head to train for `draft`: labels at eval.temperature, inner_size from the recipe
    (null: `AcceptanceHeadConfig.for_draft`'s). It starts from the head the draft came with
    (`saved_head`) when that one has the same sizes, else fresh."""
    h = recipe.acceptance_head
    fields = {"temperature": recipe.eval.temperature}
    if h.inner_size is not None:
        fields["inner_size"] = h.inner_size
    config = AcceptanceHeadConfig.for_draft(draft, **fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.train.seed)
        head = AcceptanceHead(config)
    start = saved_head(recipe, draft)
    if start is not None and start.state_dict().keys() == head.state_dict().keys():
        shapes = {k: v.shape for k, v in start.state_dict().items()}
        if shapes == {k: v.shape for k, v in head.state_dict().items()}:
            head.load_state_dict(start.state_dict())
    return head


class HeadTraining:
    """The acceptance head of a `DistillStep`, its optimiser and schedule. `schedule(step)`
    is the draft's learning-rate factor; `draft` the plain draft module, which carries the
    head (`attach_head`) so that saving the draft saves its head."""

    def __init__(self, recipe, *, accelerator: Accelerator, draft, schedule, align=align_hidden):
        h, t = recipe.acceptance_head, recipe.train
        self.accelerator = accelerator
        self.weight, self.stop_gradient = h.weight, h.stop_gradient
        self.temperature = recipe.eval.temperature
        self.top_p = recipe.loss.params.get("top_p")
        self.top_k = recipe.loss.params.get("top_k")
        self.max_grad_norm = t.max_grad_norm
        self.align = align  # the draft type's `head_hidden`: recorded states -> per depth
        self.head = build_head(recipe, draft).to(accelerator.device).train()
        self.optimizer = torch.optim.AdamW(
            self.head.parameters(),
            lr=h.lr if h.lr is not None else t.lr,
            weight_decay=t.weight_decay,
            betas=(0.9, 0.95),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        attach_head(draft, self.head)
        accelerator.register_for_checkpointing(self)

    def inputs(self, draft) -> HeadInputs:
        """The recorder of the draft's hidden states to wrap its forward in."""
        return HeadInputs(draft)

    def labels_from(self, shares: list[Share], sampling: Sampling | None) -> bool:
        """Whether the α the loss computes for `shares` (one share over every row, whose
        loss `sampling` it is) is this head's label: the same temperature (not greedy) and
        filters. Then the step hands that α over (`loss(labels=...)`) instead of the head
        computing it again over the vocabulary."""
        if len(shares) != 1 or sampling is None:
            return False
        share = shares[0]
        return (
            share.rows is None
            and 0 < share.temperature == self.temperature
            and share.loss_temperature == share.temperature
            and (sampling.top_p, sampling.top_k) == (self.top_p, self.top_k)
        )

    def loss_on(self, outputs: Outputs, d2t, labels=None) -> HeadLoss:
        """The head's loss on a micro-batch's forward (train/forward.py): per depth (`loss`),
        or chunk by chunk (`chunked_loss`); with gradients also where the draft's forward ran
        without them (train.only=acceptance_head)."""
        with torch.enable_grad():
            if isinstance(outputs, Hidden):
                target = (outputs.target, outputs.target_head)
                return self.chunked_loss(
                    outputs.draft, outputs.draft_head, target, outputs.mask, outputs.chunk_size
                )
            return self.loss(outputs.recorded, *outputs.depths, d2t, labels)

    def loss(
        self, recorded: HeadInputs, draft_logits, target_logits, masks, d2t, labels=None
    ) -> HeadLoss:
        """The head's loss over the depths of one micro-batch (the hidden states recorded
        during the draft's forward, aligned with the depths by the draft type's
        `head_hidden`), computed in float32 outside autocast. labels: α per depth at this
        head's temperature and filters, when the loss has them (`labels_from`)."""
        hidden = self.align(recorded.tensors, draft_logits)
        device_type = self.accelerator.device.type
        with torch.autocast(device_type=device_type, enabled=False):
            return head_loss(
                self.head,
                hidden,
                draft_logits,
                target_logits,
                masks,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                d2t=d2t,
                stop_gradient=self.stop_gradient,
                labels=labels,
            )

    def chunked_loss(self, d_hidden, d_head, target, mask, chunk_size: int) -> HeadLoss:
        """The head's loss where the logits exist one chunk of positions at a time (the
        step's chunked path; under the step's autocast, like the main chunked loss)."""
        return chunked_head_loss(
            self.head,
            d_hidden,
            d_head,
            target,
            mask,
            chunk_size=chunk_size,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
        )

    def update(self) -> float:
        """After a step's backward passes: average the gradients over processes, clip them
        at train.max_grad_norm, step the optimiser and the schedule. Returns the gradient
        norm before clipping."""
        acc = self.accelerator
        params = [p for p in self.head.parameters()]
        if acc.num_processes > 1:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(acc.reduce(p.grad, "mean"))
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    # accelerate's custom checkpoint object: saved and loaded with the run's state
    def state_dict(self) -> dict:
        return {
            "head": self.head.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
