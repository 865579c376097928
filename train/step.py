"""One distillation step: a frozen target, a trainable draft, an acceptance-optimising loss.

`DistillStep` holds the models, the optimiser and the learning-rate schedule, and turns one
optimiser step's micro-batches into a parameter update. The loss of a step is
Σ(per-position loss) / (valid positions in the whole global batch), so gradient accumulation
and the number of processes do not change it. The target's numbers come from a
`TargetSource` (train/targets.py): the live target, the top-N cache or the traffic records'
logprobs. Which sequences a step sees is the data order's business (train/batches.py).

With acceptance_head.enabled the step also trains the draft's acceptance head
(train/head_training.py) on the same depths, with its own optimiser; the draft carries the
head, so saving the draft saves it. With train.only=acceptance_head the draft is frozen and
only the head trains.
"""

import gc
import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from accelerate import Accelerator

from specdistill.drafts.acceptance_head import HeadLoss, attach_head, attached_head
from specdistill.drafts.align import shifted_hidden, target_mask
from specdistill.errors import UserError
from specdistill.train.config import RecipeError
from specdistill.train.distributed import (
    full_head_weight,
    is_sharded,
    load_full,
    meta_copy,
    prepare_sharded_draft,
)
from specdistill.train.head_training import HeadTraining, saved_head
from specdistill.train.objective import Objective
from specdistill.train.recipe_loss import resolved_loss
from specdistill.train.run_plan import check_checkpoint_weights, quiet_tied_head_warning
from specdistill.train.targets import LiveTarget, TargetSource
from specdistill.train.temperatures import SamplingSource, sampling_source


def trainable_parameters(module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class TrainingDiverged(UserError):
    """An optimiser step whose loss is NaN or infinite, or whose update left a trained
    parameter non-finite: the run stops there, before anything of that step is saved."""


def nonfinite_count(params: list[torch.Tensor], device) -> torch.Tensor:
    """How many of `params` hold a NaN or an infinity, as a 0-dim float64 on `device`. A
    sharded parameter (an FSDP DTensor) is checked on this process's shard: the caller sums
    the count over processes."""
    flags = [
        (~torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()).to(device)
        for p in params
    ]
    if not flags:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(flags).sum().double()


def diverged_message(step: int, numbers: dict, nonfinite: int) -> str:
    """The one line that stops a diverged run: which step, its loss (and the other numbers
    of `numbers`), how many trained tensors went non-finite."""
    shown = ", ".join(f"{name} {value:.6g}" for name, value in numbers.items())
    params = (
        f"; {nonfinite} trained parameter tensor(s) NaN or infinite after the update"
        if nonfinite
        else ""
    )
    return (
        f"training diverged at step {step}: {shown}{params}; stopped before saving anything of "
        "this step (checkpoints already written are kept): lower train.lr or raise "
        "train.warmup_steps"
    )


@dataclass
class StepMetrics:
    """What one optimiser step measured (a line of metrics.jsonl, in this key order)."""

    step: int  # the step counter after this step
    loss: float  # Σ loss / valid positions of the global batch
    alpha: float  # mean depth-0 α over the same positions
    # the draft's learning rate and gradient norm before clipping (the head's with
    # train.only=acceptance_head, where the draft does not train)
    lr: float
    grad_norm: float
    tokens: int  # valid positions of the global batch
    extra: dict = field(default_factory=dict)  # e.g. data.on_policy's generation cost
    # Σ acceptance-head loss / valid positions (acceptance_head.enabled only; else no key)
    head_loss: float | None = None

    def record(self) -> dict:
        head = {} if self.head_loss is None else {"head_loss": self.head_loss}
        return {
            "step": self.step,
            "loss": self.loss,
            "alpha": self.alpha,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "tokens": self.tokens,
            **head,
            **self.extra,
        }


def _head_labels(head, objective, shares) -> list | None:
    """An empty list for the loss to fill with the acceptance head's labels where they are
    the loss's own α (`HeadTraining.labels_from`), else None: the head computes them."""
    if head is None or objective.token is None or not shares:
        return None
    return [] if head.labels_from(shares, objective.sampling(shares[0])) else None


def check_finite(metrics: StepMetrics, nonfinite: int) -> None:
    """`TrainingDiverged` unless the step's losses are finite and no trained parameter went
    NaN or infinite."""
    losses = {"loss": metrics.loss}
    if metrics.head_loss is not None:
        losses["head_loss"] = metrics.head_loss
    if nonfinite or not all(math.isfinite(v) for v in losses.values()):
        numbers = {**losses, "alpha": metrics.alpha, "grad norm": metrics.grad_norm}
        raise TrainingDiverged(diverged_message(metrics.step, numbers, nonfinite))


class StepLosses(NamedTuple):
    """One micro-batch's terms: the draft's Σ loss (with its graph), the detached Σ α at
    depth 0, and the acceptance head's loss (None without a head)."""

    loss_sum: torch.Tensor
    alpha_sum: torch.Tensor
    head: HeadLoss | None


class DistillStep:
    """The trainable state of a distillation (draft, optimiser, schedule, step counter) and
    the step that updates it. `draft` is a module not yet prepared; `kind` its draft type.

    The frozen target is never trained and never handed to accelerate (so never wrapped or
    sharded); every process holds a whole copy (train/distributed.py).
    """

    def __init__(self, recipe, *, accelerator: Accelerator, target, draft, kind, targets=None):
        r = recipe
        self.loss_cfg, self.max_grad_norm = r.loss, r.train.max_grad_norm
        self.accelerator = acc = accelerator
        self.kind, self.vocab_size = kind, kind.vocab_size
        self.step = 0
        self.target = target.eval().requires_grad_(False).to(acc.device)
        # train.only=acceptance_head: the draft is frozen like the target (never prepared,
        # never in an optimiser) and only its acceptance head trains.
        self.frozen = r.train.only == "acceptance_head"
        t = r.train

        def schedule(s: int) -> float:
            return lr_lambda(s, t.warmup_steps, t.max_steps, t.min_lr_ratio)

        if self.frozen:
            self._frame = None
            self.draft = draft.eval().requires_grad_(False).to(acc.device)
            self.optimizer = self.scheduler = None
        else:
            # A sharded draft (FSDP, ZeRO-3) is gathered into this frame on the main process
            # to be saved or decoded alone (`full_draft`); parameters on the meta device cost
            # nothing.
            self._frame = meta_copy(draft) if is_sharded(acc) and acc.is_main_process else None
            draft.train()
            params = [p for p in draft.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(
                params, lr=r.train.lr, weight_decay=r.train.weight_decay, betas=(0.9, 0.95)
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
            self.draft, self.optimizer = acc.prepare(draft, optimizer)
            prepare_sharded_draft(acc, self.draft)
            acc.register_for_checkpointing(self.scheduler)
        # The acceptance head (acceptance_head.enabled): its own optimiser, carried by the
        # draft module. Without it, a head the draft came with stays attached, untrained.
        self.head_training: HeadTraining | None = None
        if r.acceptance_head.enabled:
            self.head_training = HeadTraining(
                r,
                accelerator=acc,
                draft=self.draft_module(),
                schedule=schedule,
                align=kind.head_hidden,
            )
        else:
            loaded = saved_head(r, self.draft_module())
            if loaded is not None:
                attach_head(self.draft_module(), loaded)
        self.targets: TargetSource = targets or LiveTarget(kind, self.target)
        # The loss, resolved once (its per-token part, the draft's own chains), and the
        # served sampling it is taken at (loss.temperature; `traffic`: set per refresh by
        # the online job).
        self.objective = Objective(resolved_loss(r), seed=r.train.seed)
        self.default_sampling: SamplingSource | None = sampling_source(r)
        self.sampling = self.default_sampling
        self._calls = 0  # micro-batches of this step so far (seeds the chains' sampling)

    @property
    def head(self):
        """The acceptance head the draft carries (trained here or loaded with it), or None."""
        return attached_head(self.draft_module())

    def train_mode(self) -> None:
        """Back to training after an evaluation (a frozen draft stays in eval mode)."""
        if not self.frozen:
            self.draft.train()

    def set_targets(self, source: TargetSource | None) -> None:
        """Where the target's numbers come from (None: the live target)."""
        self.targets = source or LiveTarget(self.kind, self.target)

    def set_sampling(self, source: SamplingSource | None) -> None:
        """The served sampling of the loss (None: the recipe's loss.temperature)."""
        self.sampling = source or self.default_sampling

    def draft_module(self):
        """The draft as a plain module (unwrapped from DDP / FSDP)."""
        return self.accelerator.unwrap_model(self.draft)

    def release_wrapper(self) -> None:
        """At the end of a run, before the process group is destroyed: the draft is unwrapped
        and its DDP wrapper freed. DDP's reducer holds the gloo process group from C++. Were
        it the last holder, freeing it (with the GIL held) would join gloo's worker threads
        while one of them may still be freeing a finished collective's tensors, which needs
        the GIL: the process could hang at exit. Freed while torch.distributed still holds
        the group, the reducer only lets go of it; destroying the group then frees it with
        the GIL released."""
        if self.frozen or self.draft is self.draft_module():
            return
        self.draft = self.draft_module()
        self.accelerator.free_memory()
        gc.collect()  # whatever of the wrapper sits in a reference cycle

    # ----------------------------------------------------------------------------- step
    def train_step(self, batches: list[dict]) -> StepMetrics:
        """One optimiser step on this process's micro-batches of the global batch.
        `TrainingDiverged` (on every process alike) when the step's loss is not finite or
        its update leaves a trained parameter non-finite."""
        acc, head = self.accelerator, self.head_training
        self._calls = 0
        n_local = sum(int(self.kind.count_mask(b).sum()) for b in batches)
        n_global = acc.reduce(torch.tensor(n_local, device=acc.device), "sum").item()
        # DDP averages gradients over processes; scale by the world size so the step's
        # gradient is Σ loss / n_global exactly.
        scale = acc.num_processes / max(n_global, 1)
        # [Σ loss, Σ α] (+ Σ head loss with an acceptance head)
        stats = torch.zeros(2 if head is None else 3, dtype=torch.float64, device=acc.device)
        for i, batch in enumerate(batches):
            sync = i == len(batches) - 1
            with acc.no_sync(self.draft) if not sync else nullcontext(), acc.autocast():
                parts = self.losses(batch)
                self.backward(parts, scale)
            stats[0] += parts.loss_sum.detach().double()
            stats[1] += parts.alpha_sum.double()
            if parts.head is not None:
                stats[2] += parts.head.loss_sum.detach().double()
        if self.frozen:
            grad_norm = head.update()
            lr = head.lr()
        else:
            grad_norm = acc.clip_grad_norm_(self.draft.parameters(), self.max_grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            lr = self.scheduler.get_last_lr()[0]
            if head is not None:
                head.update()
        # the count of non-finite trained parameters rides along with the sums
        stats = torch.cat([stats, nonfinite_count(self.trained_parameters(), acc.device)[None]])
        stats = acc.reduce(stats, "sum")
        denom = max(n_global, 1)
        self.step += 1
        metrics = StepMetrics(
            step=self.step,
            loss=stats[0].item() / denom,
            alpha=stats[1].item() / denom,
            lr=lr,
            grad_norm=float(grad_norm),
            tokens=n_global,
            head_loss=None if head is None else stats[2].item() / denom,
        )
        check_finite(metrics, int(stats[-1].item()))
        return metrics

    def trained_parameters(self) -> list[torch.Tensor]:
        """The parameters the optimisers update: the draft's (unless frozen) and its
        acceptance head's."""
        optimizers = [] if self.frozen else [self.optimizer]
        if self.head_training is not None:
            optimizers.append(self.head_training.optimizer)
        return [p for opt in optimizers for group in opt.param_groups for p in group["params"]]

    def backward(self, parts: "StepLosses", scale: float) -> None:
        """The backward passes of one micro-batch: the draft's loss through accelerate, the
        head's (weighted) on its own graph, or, with acceptance_head.stop_gradient=false,
        added to the draft's."""
        head = self.head_training
        head_term = None if parts.head is None else head.weight * parts.head.loss_sum
        if self.frozen:
            (head_term * scale).backward()
        elif head_term is None:
            self.accelerator.backward(parts.loss_sum * scale)
        elif head.stop_gradient:
            self.accelerator.backward(parts.loss_sum * scale)
            (head_term * scale).backward()
        else:
            self.accelerator.backward((parts.loss_sum + head_term) * scale)

    def loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ loss over valid positions, detached Σ α at depth 0) for one micro-batch."""
        parts = self.losses(batch)
        return parts.loss_sum, parts.alpha_sum

    def losses(self, batch: dict) -> "StepLosses":
        """The draft's loss and α, and the acceptance head's loss, of one micro-batch. A
        frozen draft (train.only=acceptance_head) runs without gradients."""
        with torch.no_grad() if self.frozen else nullcontext():
            if self.loss_cfg.chunk_size is None:
                return self._direct(batch)
            return self._chunked(batch)

    def _shares(self, batch: dict):
        if self.sampling is None:
            raise RecipeError(
                "loss.temperature=traffic needs the traffic records' sampling (the online job)"
            )
        self._calls += 1
        return self.sampling.shares(batch)

    def _direct(self, batch: dict) -> "StepLosses":
        head, objective = self.head_training, self.objective
        shares = self._shares(batch)
        token = head_part = None
        if objective.token is not None or head is not None:
            record = head.inputs(self.draft_module()) if head is not None else nullcontext()
            with record:
                depths = self.targets.depths(self.draft, batch)
            labels = _head_labels(head, objective, shares)
            if objective.token is not None:
                token = objective.token_sums(depths, shares, self.vocab_map(), labels)
            if head is not None:
                with torch.enable_grad():
                    head_part = head.loss(record, *depths, self.vocab_map(), labels)
        sums = objective.sums(self, batch, shares, token, self._calls)
        return StepLosses(sums.loss_sum, sums.alpha_sum, head_part)

    def _chunked(self, batch: dict) -> "StepLosses":
        lo, head, objective = self.loss_cfg, self.head_training, self.objective
        shares = self._shares(batch)
        if objective.token is None and head is None:
            return StepLosses(*objective.sums(self, batch, shares, None, self._calls), None)
        mask = target_mask(batch)
        # Chunked: logits exist one chunk of positions at a time, for both models.
        with torch.no_grad():
            t_hidden = shifted_hidden(self.target, batch)
        d_hidden = shifted_hidden(self.draft, batch)
        t_head, d_head = self.heads()
        token = None
        if objective.token is not None:  # α from the chunks the loss computes: no second pass
            token = objective.chunked_token_sums(
                d_hidden, d_head, (t_hidden, t_head), mask, shares, lo.chunk_size
            )
        loss_sum, alpha_sum = objective.sums(self, batch, shares, token, self._calls)
        head_part = None
        if head is not None:
            with torch.enable_grad():
                head_part = head.chunked_loss(
                    d_hidden, d_head, (t_hidden, t_head), mask, lo.chunk_size
                )
        return StepLosses(loss_sum, alpha_sum, head_part)

    def vocab_map(self):
        """An EAGLE-3 head's d2t (draft id -> target id offsets), read from the running head,
        so that a head whose buffers were loaded from elsewhere is mapped by its own; None
        for a draft over the target's whole vocabulary."""
        if self.kind.d2t is None:
            return None
        return self.draft_module().d2t

    def heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Output-head weights [vocab_size, hidden] of target and draft, for chunked losses.
        The draft's is its whole, trained parameter also when FSDP shards the draft
        (train/distributed.py `full_head_weight`)."""
        weights = []
        for role, model in (("target", self.target), ("draft", self.draft_module())):
            head = model.get_output_embeddings()
            if hasattr(head, "base_layer"):  # a peft LoRA layer: .weight misses its delta
                raise RecipeError(
                    f"loss.chunk_size cannot use the {role}'s output head: a LoRA adapter "
                    "wraps it (set loss.chunk_size=null)"
                )
            if head.bias is not None:
                raise RecipeError(
                    f"loss.chunk_size needs a bias-free output head; the {role}'s has a bias "
                    "(set loss.chunk_size=null)"
                )
            weight = head.weight if role == "target" else full_head_weight(head)
            weights.append(weight[: self.vocab_size])
        return weights[0], weights[1]

    def full_draft(self):
        """The trained draft as one plain module on the main process, None on the others;
        every process must call it. Replicated (one process, DDP, ZeRO-1/2): the unwrapped
        draft itself. Sharded (FSDP, ZeRO-3): a copy holding the full weights, gathered with
        `Accelerator.get_state_dict`, in which every process takes part. Either carries
        the draft's acceptance head, when it has one."""
        acc = self.accelerator
        if self.frozen or not is_sharded(acc):
            return self.draft_module() if acc.is_main_process else None
        head = self.head
        state = acc.get_state_dict(self.draft)
        if not acc.is_main_process:
            return None
        full = load_full(self._frame, state, acc.device)
        attach_head(full, head)
        return full

    # ----------------------------------------------------------------------------- state
    def save_state(self, directory) -> None:
        """Draft, optimiser, schedule and RNG states into `directory` (accelerate's
        save_state, safetensors weights), with the acceptance head's state (a registered
        custom object) when it trains; every process calls it."""
        with quiet_tied_head_warning(self.draft_module()):
            self.accelerator.save_state(str(directory), safe_serialization=True)

    def load_state(self, directory, *, step: int) -> None:
        """What `save_state` wrote, all or nothing for the weights (their names and shapes
        are checked first: `check_checkpoint_weights`), and the step counter."""
        check_checkpoint_weights(directory, self.draft)
        self.accelerator.load_state(str(directory))
        self.step = step
