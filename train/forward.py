"""The forward of one micro-batch: the target's outputs and the draft's, in the form the step's
losses read (train/step.py runs it, train/objective.py and train/head_training.py read it).

- `TeacherForced`: per depth (draft logits, target logits or sparse targets, masks), from the
  step's `TargetSource` (train/targets.py), which runs the target (or looks its outputs up)
  and the draft, aligned by the draft type; with an acceptance head, the draft's hidden states
  recorded during its forward (`HeadInputs`).
- `Hidden` (loss.chunk_size): the last hidden states of both models and their output heads;
  the logits exist one chunk of positions at a time, inside the losses.
"""

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from specdistill.drafts.acceptance_head import HeadInputs
from specdistill.drafts.align import shifted_hidden, target_mask
from specdistill.train.distributed import full_head_weight
from specdistill.train.recipe_errors import RecipeError
from specdistill.train.targets import Depths, TargetSource


@dataclass
class TeacherForced:
    """Both models' outputs per depth, and what the acceptance head reads of the draft's."""

    depths: Depths  # (draft logits, target logits or sparse targets, masks), one per depth
    recorded: HeadInputs | None = None  # the draft's hidden states (with an acceptance head)


@dataclass
class Hidden:
    """Both models' last hidden states, shifted to the positions they predict, and their
    output heads: the chunked losses make the logits one chunk of positions at a time."""

    target: Tensor  # [B, T, H] the target's (no graph)
    draft: Tensor  # [B, T, H] the draft's (with its graph)
    target_head: Tensor  # [V, H] output-head weights
    draft_head: Tensor
    mask: Tensor  # [B, T] the positions the loss covers
    chunk_size: int


Outputs = TeacherForced | Hidden


def teacher_forced(
    targets: TargetSource, draft, batch: dict, recorder: HeadInputs | None = None
) -> TeacherForced:
    """The target source's depths of `batch`, the draft's forward recorded by `recorder`."""
    with recorder if recorder is not None else nullcontext():
        depths = targets.depths(draft, batch)
    return TeacherForced(depths, recorder)


def hidden(target, draft, batch: dict, draft_module, vocab_size: int, chunk_size: int) -> Hidden:
    """The target's forward (no graph), then the draft's; their output heads read after the
    draft's forward (a sharded draft holds its whole head then: `full_head_weight`)."""
    mask = target_mask(batch)
    with torch.no_grad():
        t_hidden = shifted_hidden(target, batch)
    d_hidden = shifted_hidden(draft, batch)
    t_head, d_head = output_heads(target, draft_module, vocab_size)
    return Hidden(t_hidden, d_hidden, t_head, d_head, mask, chunk_size)


def output_heads(target, draft_module, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Output-head weights [vocab_size, hidden] of target and draft, for chunked losses.
    The draft's is its whole, trained parameter also when FSDP shards the draft
    (train/distributed.py `full_head_weight`)."""
    weights = []
    for role, model in (("target", target), ("draft", draft_module)):
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
        weights.append(weight[:vocab_size])
    return weights[0], weights[1]
