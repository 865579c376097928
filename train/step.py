"""One distillation step: a frozen target, a trainable draft, an acceptance-optimising loss.

`DistillStep` holds the models, the optimiser and the learning-rate schedule, and turns one
optimiser step's micro-batches into a parameter update. The loss of a step is
Σ(per-position loss) / (valid positions in the whole global batch), so gradient accumulation
and the number of processes do not change it. The target's numbers come from a
`TargetSource` (train/targets.py): the live target, the top-N cache or the traffic records'
logprobs. Which sequences a step sees is the data order's business (train/batches.py).

`DistillStep.train_step` tells a step's story in order, one call per stage: the data's valid
positions (`global_batch`), then per micro-batch its served sampling (`shares`), the forward
of the target and the draft (`forward`, train/forward.py), the losses (`micro_losses`: the
draft's from train/objective.py, the head's from train/head_training.py) and `backward`;
then `update` and `metrics`.

With acceptance_head.enabled the step also trains the draft's acceptance head
(train/head_training.py) on the same depths, with its own optimiser; the draft carries the
head, so saving the draft saves it. With train.only=acceptance_head the draft is frozen and
only the head trains.
"""

import gc
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from accelerate import Accelerator

from specdistill.drafts.acceptance_head import HeadLoss, attach_head, attached_head
from specdistill.errors import UserError
from specdistill.train.config import RecipeError
from specdistill.train.distributed import is_sharded, load_full, meta_copy, prepare_sharded_draft
from specdistill.train.forward import Outputs, TeacherForced, hidden, output_heads, teacher_forced
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


@dataclass(frozen=True)
class GlobalBatch:
    """The step's denominator: the valid positions of the whole global batch, and the factor
    of each process's backward that makes the step's gradient Σ loss / tokens."""

    tokens: int
    scale: float


class StepLosses(NamedTuple):
    """One micro-batch's terms: the draft's Σ loss (with its graph), the detached Σ α at
    depth 0, and the acceptance head's loss (None without a head)."""

    loss_sum: torch.Tensor
    alpha_sum: torch.Tensor
    head: HeadLoss | None


@dataclass
class StepSums:
    """This process's running sums over its micro-batches, float64: [Σ loss, Σ α] (+ Σ head
    loss with an acceptance head)."""

    values: torch.Tensor

    @classmethod
    def zeros(cls, head: bool, device) -> "StepSums":
        return cls(torch.zeros(3 if head else 2, dtype=torch.float64, device=device))

    def add(self, losses: StepLosses) -> None:
        self.values[0] += losses.loss_sum.detach().double()
        self.values[1] += losses.alpha_sum.double()
        if losses.head is not None:
            self.values[2] += losses.head.loss_sum.detach().double()


@dataclass(frozen=True)
class Update:
    """What an update reports: the draft's gradient norm before clipping and learning rate
    (the head's with train.only=acceptance_head, where the draft does not train)."""

    grad_norm: float
    lr: float


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
        """One optimiser step on this process's micro-batches of the global batch, top to
        bottom. `TrainingDiverged` (on every process alike) when the step's loss is not
        finite or its update leaves a trained parameter non-finite."""
        self._calls = 0
        global_batch = self.global_batch(batches)  # data: the valid positions, the scale
        sums = StepSums.zeros(self.head_training is not None, self.accelerator.device)
        for i, batch in enumerate(batches):
            with self.micro_batch(last=i == len(batches) - 1):
                shares = self.shares(batch)  # the served sampling the loss is taken at
                outputs = self.forward(batch)  # the target's outputs, then the draft's
                losses = self.micro_losses(batch, shares, outputs)  # the draft's, the head's
                self.backward(losses, global_batch.scale)
            sums.add(losses)
        update = self.update()  # clip, optimiser and schedule steps
        return self.metrics(sums, update, global_batch)  # over processes, checked finite

    def global_batch(self, batches: list[dict]) -> GlobalBatch:
        """The valid positions of the global batch (every process's `batches`)."""
        acc = self.accelerator
        n_local = sum(int(self.kind.count_mask(b).sum()) for b in batches)
        n_global = acc.reduce(torch.tensor(n_local, device=acc.device), "sum").item()
        # DDP averages gradients over processes; scale by the world size so the step's
        # gradient is Σ loss / n_global exactly.
        return GlobalBatch(n_global, acc.num_processes / max(n_global, 1))

    @contextmanager
    def micro_batch(self, last: bool):
        """Around a micro-batch's forward and backward: accelerate's autocast and, on all but
        the step's last micro-batch, no gradient sync between processes."""
        acc = self.accelerator
        with acc.no_sync(self.draft) if not last else nullcontext(), acc.autocast():
            yield

    def shares(self, batch: dict):
        """The served-sampling shares the loss of `batch` is taken at (train/temperatures.py)."""
        if self.sampling is None:
            raise RecipeError(
                "loss.temperature=traffic needs the traffic records' sampling (the online job)"
            )
        self._calls += 1
        return self.sampling.shares(batch)

    def forward(self, batch: dict) -> Outputs | None:
        """The target's outputs and the draft's on `batch` (train/forward.py): per depth from
        the target source, or hidden states with loss.chunk_size. None where no loss reads
        them (the draft's own chains alone: they run their own forwards). A frozen draft
        (train.only=acceptance_head) runs without gradients."""
        head = self.head_training
        if self.objective.token is None and head is None:
            return None
        with torch.no_grad() if self.frozen else nullcontext():
            chunk = self.loss_cfg.chunk_size
            if chunk is not None:
                return hidden(
                    self.target, self.draft, batch, self.draft_module(), self.vocab_size, chunk
                )
            recorder = head.inputs(self.draft_module()) if head is not None else None
            return teacher_forced(self.targets, self.draft, batch, recorder)

    def micro_losses(self, batch: dict, shares, outputs: Outputs | None) -> StepLosses:
        """The draft's loss and α (the per-token part on `outputs`, the chain part on the
        draft's own chains: train/objective.py) and the acceptance head's loss of one
        micro-batch. Where the loss is at the head's temperature, its α are the head's
        labels (`HeadTraining.labels_from`)."""
        head, objective = self.head_training, self.objective
        per_depth = isinstance(outputs, TeacherForced)
        labels = _head_labels(head, objective, shares) if per_depth else None
        with torch.no_grad() if self.frozen else nullcontext():
            token = None
            if objective.token is not None:
                token = objective.token_part(outputs, shares, self.vocab_map(), labels)
            sums = objective.sums(self, batch, shares, token, self._calls)
        head_loss = None if head is None else head.loss_on(outputs, self.vocab_map(), labels)
        return StepLosses(sums.loss_sum, sums.alpha_sum, head_loss)

    def backward(self, parts: StepLosses, scale: float) -> None:
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

    def update(self) -> Update:
        """After the step's backward passes: clip the gradients, step the optimisers and
        schedules (the draft's, then the head's)."""
        head = self.head_training
        if self.frozen:
            grad_norm = head.update()
            return Update(grad_norm, head.lr())
        grad_norm = self.accelerator.clip_grad_norm_(self.draft.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        if head is not None:
            head.update()
        return Update(float(grad_norm), lr)

    def metrics(self, sums: StepSums, update: Update, global_batch: GlobalBatch) -> StepMetrics:
        """The step's numbers, summed over processes and divided by the global batch's valid
        positions; the step counter advances. `TrainingDiverged` unless they are finite."""
        acc = self.accelerator
        # the count of non-finite trained parameters rides along with the sums
        nonfinite = nonfinite_count(self.trained_parameters(), acc.device)
        stats = acc.reduce(torch.cat([sums.values, nonfinite[None]]), "sum")
        denom = max(global_batch.tokens, 1)
        self.step += 1
        metrics = StepMetrics(
            step=self.step,
            loss=stats[0].item() / denom,
            alpha=stats[1].item() / denom,
            lr=update.lr,
            grad_norm=update.grad_norm,
            tokens=global_batch.tokens,
            head_loss=None if self.head_training is None else stats[2].item() / denom,
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

    def loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ loss over valid positions, detached Σ α at depth 0) for one micro-batch."""
        parts = self.losses(batch)
        return parts.loss_sum, parts.alpha_sum

    def losses(self, batch: dict) -> StepLosses:
        """One micro-batch's losses outside a step: its sampling, forward and losses."""
        shares = self.shares(batch)
        return self.micro_losses(batch, shares, self.forward(batch))

    def vocab_map(self):
        """An EAGLE-3 head's d2t (draft id -> target id offsets), read from the running head,
        so that a head whose buffers were loaded from elsewhere is mapped by its own; None
        for a draft over the target's whole vocabulary."""
        if self.kind.d2t is None:
            return None
        return self.draft_module().d2t

    def heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Output-head weights [vocab_size, hidden] of target and draft, for chunked losses
        (train/forward.py `output_heads`)."""
        return output_heads(self.target, self.draft_module(), self.vocab_size)

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
