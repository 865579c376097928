"""What the trainer needs to know about how the draft is spread over processes.

Three layouts, chosen by `accelerate launch` (configs in recipes/accelerate/):

- replicated: one process, DDP, DeepSpeed ZeRO-1/2. Every process holds the whole draft.
- FSDP (FSDP2, `fully_shard`): each process holds a shard of every parameter (a DTensor);
  a forward all-gathers them, so every process must run the same sequence of forwards.
- DeepSpeed ZeRO-3: the same, with DeepSpeed's partitioned parameters.

The frozen target is never sharded: it is not passed to `accelerate.prepare` (accelerate's
FSDP2 takes exactly one model, and only with its optimizer), so every process holds a
whole copy in `target.dtype`, in eval mode, without gradients.

FSDP without a GPU: accelerate (1.15) only turns a run into FSDP when its processes sit on an
accelerator (MULTI_GPU, ...). Processes on CPUs become MULTI_CPU (DDP over gloo) and the
FSDP settings of the launch are silently dropped. `make_accelerator` restores them for FSDP2,
which runs over gloo (FSDP1 refuses CPU processes: "Inconsistent compute device and
`device_id`").
"""

import copy
import os

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from specdistill.train.config import RecipeError


class ShardingError(RecipeError):
    """A sharded layout that this run cannot use (the message names the fix)."""


def make_accelerator(mixed_precision: str) -> Accelerator:
    """The run's Accelerator as `accelerate launch` configured it.

    Without a GPU, `cpu=True`: processes started by torchrun / `accelerate launch
    --multi_gpu` then form a gloo group (accelerate only does that when told it is on the
    CPU), and an FSDP launch (ACCELERATE_USE_FSDP, e.g. recipes/accelerate/fsdp.yaml) is
    run as FSDP2 over gloo instead of falling back to DDP."""
    cpu = not torch.cuda.is_available()
    acc = Accelerator(mixed_precision=mixed_precision, cpu=cpu)
    fsdp_asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if cpu and fsdp_asked and acc.distributed_type == DistributedType.MULTI_CPU:
        _fsdp_over_gloo(acc)
    return acc


def _fsdp_over_gloo(acc: Accelerator) -> None:
    """Make a MULTI_CPU Accelerator an FSDP2 one, as AcceleratorState does for GPU processes
    (state.py: distributed_type = FSDP, fsdp_plugin from the launch's FSDP_* variables,
    with the run's mixed precision). PartialState holds the type too: AcceleratorState
    copies it back in every time it is instantiated."""
    plugin = FullyShardedDataParallelPlugin()  # reads FSDP_VERSION, FSDP_* as accelerate does
    if plugin.fsdp_version != 2:
        raise ShardingError(
            "FSDP on CPU processes needs FSDP2 (fsdp_version: 2 in the accelerate config, or "
            "--fsdp_version 2): FSDP1 does not run without a GPU"
        )
    if acc.mixed_precision != "no":
        plugin.set_mixed_precision(acc.mixed_precision)
    PartialState().distributed_type = DistributedType.FSDP
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin


def is_sharded(acc: Accelerator) -> bool:
    """Whether no process holds the whole draft between forwards (FSDP, ZeRO-3)."""
    if acc.distributed_type == DistributedType.FSDP:
        return True
    if acc.distributed_type == DistributedType.DEEPSPEED:
        return acc.state.deepspeed_plugin.zero_stage == 3
    return False


def check_layout(
    acc: Accelerator, accum: int, max_grad_norm: float, chunk_size: int | None = None
) -> None:
    """Refuse, before training, what the trainer's step cannot do under the run's layout.
    DeepSpeed (accelerate's `backward` runs DeepSpeed's optimizer step at every call outside
    `accumulate`) needs one micro-batch per process per step and clips at its own
    gradient_clipping; ZeRO-3 and FSDP1 keep the output head sharded outside the forward,
    where the chunked loss reads it."""
    if acc.distributed_type == DistributedType.FSDP:
        if chunk_size is not None and acc.state.fsdp_plugin.fsdp_version != 2:
            raise ShardingError(
                "loss.chunk_size under FSDP needs FSDP2 (fsdp_version: 2, as "
                "recipes/accelerate/fsdp.yaml), or loss.chunk_size=null"
            )
        return
    if acc.distributed_type != DistributedType.DEEPSPEED:
        return
    if chunk_size is not None and acc.state.deepspeed_plugin.zero_stage == 3:
        raise ShardingError(
            "loss.chunk_size is not supported with DeepSpeed ZeRO-3 (the draft's output head "
            "is partitioned outside its forward): use FSDP or ZeRO-2, or loss.chunk_size=null"
        )
    if accum != 1:
        raise ShardingError(
            f"DeepSpeed steps the optimizer after every backward, and a step here has {accum} "
            "micro-batches per process: set train.micro_batch_size to train.global_batch_size "
            f"/ processes ({acc.num_processes})"
        )
    clip = acc.state.deepspeed_plugin.deepspeed_config.get("gradient_clipping", "auto")
    if clip != "auto" and float(clip) != max_grad_norm:
        raise ShardingError(
            f"DeepSpeed clips gradients at gradient_clipping = {clip} (its config), the recipe "
            f"at train.max_grad_norm = {max_grad_norm}: make them equal"
        )


def layout(acc: Accelerator) -> str:
    """How the draft is spread, in words for the run's first line: single, DDP, FSDP2, ..."""
    kind = acc.distributed_type
    if kind == DistributedType.FSDP:
        return f"FSDP{acc.state.fsdp_plugin.fsdp_version}"
    if kind == DistributedType.DEEPSPEED:
        return f"DeepSpeed ZeRO-{acc.state.deepspeed_plugin.zero_stage}"
    if kind == DistributedType.NO or acc.num_processes == 1:
        return "single"
    return "DDP"


def meta_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` whose parameters are on the meta device (no memory; ties kept)
    and whose buffers are real copies. Made before sharding, it is the frame into which
    a gathered state dict is loaded (`load_full`)."""
    memo = {}
    for p in module.parameters():
        shape = getattr(p, "ds_shape", p.shape)  # a ZeRO-3 parameter made under zero.Init
        memo[id(p)] = torch.nn.Parameter(
            torch.empty(shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad
        )
    return copy.deepcopy(module, memo)


def load_full(frame: torch.nn.Module, state: dict, device) -> torch.nn.Module:
    """A plain module: a copy of `frame` (from `meta_copy`) holding `state` (a full state
    dict, e.g. `Accelerator.get_state_dict` on the main process), on `device`."""
    model = copy.deepcopy(frame)
    _, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if hasattr(model, "tie_weights"):  # assign=True replaced tied parameters one by one
        model.tie_weights()
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    empty = [name for name, t in tensors if t.is_meta]
    if unexpected or empty:
        raise RuntimeError(
            f"the gathered draft does not fit its frame: not loaded {empty}, "
            f"unexpected {unexpected}"
        )
    return model.to(device)


def full_head_weight(head: torch.nn.Module) -> torch.Tensor:
    """`head.weight` (the draft's output head, read by the chunked loss after the draft's
    forward) as the whole, trained parameter, or a ShardingError.

    FSDP2: the unit that holds the head is not resharded after the forward
    (`prepare_sharded_draft`), so the module holds the full parameter until the backward, and
    FSDP's post-backward reduce-scatters the gradient the loss puts on it like any other.
    DeepSpeed ZeRO-3 partitions it outside the forward: refused."""
    weight = head.weight
    if _is_dtensor(weight):
        raise ShardingError(
            "loss.chunk_size: the draft's output head is still sharded after the forward "
            "(set loss.chunk_size=null)"
        )
    if hasattr(weight, "ds_id"):  # DeepSpeed ZeRO-3: partitioned outside the module's forward
        raise ShardingError(
            "loss.chunk_size is not supported with DeepSpeed ZeRO-3 (the draft's output head "
            "is partitioned outside its forward): use FSDP or ZeRO-2, or loss.chunk_size=null"
        )
    return weight


def prepare_sharded_draft(acc: Accelerator, draft: torch.nn.Module) -> None:
    """After `accelerate.prepare`, FSDP2: the unit that holds the draft's output head keeps
    its full parameters from the forward to the backward, so that the chunked loss, which
    reads the head after the forward, finds the whole of it (`full_head_weight`). accelerate
    1.15 already builds that unit so (a "tail" unit of the final norm and the head, with
    reshard_after_forward=False, as the backward needs them at once); this holds whichever
    unit another version or wrap policy puts the head in."""
    if not getattr(acc, "is_fsdp2", False):
        return
    model = acc.unwrap_model(draft)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    unit = _fsdp_unit_of(model, head) if head is not None else None
    if unit is not None:
        unit.set_reshard_after_forward(False, recurse=False)


def _is_dtensor(t) -> bool:
    # lazy: torch.distributed.tensor is slow to import; the chunked loss asks
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _fsdp_unit_of(model: torch.nn.Module, sub: torch.nn.Module):
    """The innermost FSDP2 module of `model` that contains `sub` (None if none does)."""
    # lazy: loads torch.distributed.tensor (slow); only FSDP2 runs ask
    from torch.distributed.fsdp import FSDPModule

    owner = None
    for module in model.modules():  # parents before children
        if isinstance(module, FSDPModule) and any(m is sub for m in module.modules()):
            owner = module
    return owner
