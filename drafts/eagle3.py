"""The EAGLE-3 draft type: a head on the target's features (the module: drafts/eagle3_head.py).

K = `draft.ttt_steps` depths of training-time test, each aligned with the target by
`align_depths`; the target's features are captured in the same forward that gives its
logits. Saved in the `speculators` layout vLLM loads (docs/theory.md §4, §5).
"""

from pathlib import Path

import torch
from torch import Tensor

from specdistill.drafts.eagle3_head import (
    Eagle3Head,
    FeatureCapture,
    align_depths,
    build_vocab_map,
)

Depths = tuple[list[Tensor], list[Tensor], list[Tensor]]


class Eagle3:
    name = "eagle3"

    def __init__(self, head: Eagle3Head, steps: int, vocab_size: int):
        if steps < 1:
            raise ValueError(f"draft.ttt_steps must be >= 1, got {steps}")
        self.steps, self.vocab_size = steps, vocab_size
        self.aux_layers = head.aux_layers
        self.dtype = head.fc.weight.dtype
        self.d2t = head.d2t if head.draft_vocab_size < vocab_size else None

    def count_mask(self, batch: dict) -> Tensor:
        valid = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        length = valid.shape[1] - self.steps - 1
        return valid[:, 2 : 2 + length]

    def target_forward(self, target, batch: dict) -> tuple[Tensor, Tensor]:
        """(target logits [B, T, vocab], features [B, T, n_aux·H_t]) from one forward."""
        with torch.no_grad(), FeatureCapture(target, self.aux_layers) as capture:
            out = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            return out.logits[..., : self.vocab_size], capture.features()

    def depths(self, draft, target, batch: dict) -> Depths:
        t_logits, features = self.target_forward(target, batch)
        # Through forward (not .unroll) so that a DDP / FSDP wrapper sees the call.
        logits = draft(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            features=features.to(self.dtype),
            ttt_steps=self.steps,
        )
        return align_depths(logits, t_logits, batch["loss_mask"], batch["attention_mask"])

    def save(self, draft, out: Path, tokenizer, verifier: str) -> None:
        draft.save_pretrained(out, verifier=verifier)
        tokenizer.save_pretrained(out)


def token_counts(dataset, vocab_size: int) -> Tensor:
    """Frequency of every token id among the loss-masked tokens of `dataset`: [vocab_size]."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(len(dataset)):
        item = dataset[i]
        ids = torch.as_tensor(item["input_ids"])[torch.as_tensor(item["loss_mask"]).bool()]
        counts += torch.bincount(ids.clamp_max(vocab_size - 1), minlength=vocab_size)
    return counts


def new_eagle3_head(target, recipe_draft, train_data, vocab_size: int) -> Eagle3Head:
    """A fresh head for `target`, with its draft vocabulary built from `train_data`."""
    d = recipe_draft
    head = Eagle3Head.from_target(
        target,
        draft_vocab_size=d.vocab_size or vocab_size,
        aux_layers=d.aux_layers,
        intermediate_size=d.intermediate_size,
        norm_before_residual=d.norm_before_residual,
        vocab_size=vocab_size,
    )
    if head.draft_vocab_size < vocab_size:
        d2t, t2d = build_vocab_map(token_counts(train_data, vocab_size), head.draft_vocab_size)
        head.set_vocab_map(d2t, t2d, target.get_output_embeddings().weight[:vocab_size])
    return head
