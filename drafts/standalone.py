"""The standalone draft type: a small causal LM that shares the target's tokenizer.

One depth: position t of the draft predicts token t+1 from the tokens alone, compared with
the target at the same position (drafts/align.py). Saved as a plain Hugging Face directory,
which is also what serving engines load (docs/theory.md §5).
"""

from pathlib import Path

import torch
from torch import Tensor

from specdistill.drafts.align import shifted_logits, target_mask

Depths = tuple[list[Tensor], list[Tensor], list[Tensor]]


class Standalone:
    name = "standalone"
    d2t = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def count_mask(self, batch: dict) -> Tensor:
        """The positions a step's loss is normalised by (depth 0's mask)."""
        return target_mask(batch)

    def depths(self, draft, target, batch: dict) -> Depths:
        with torch.no_grad():
            t_logits = shifted_logits(target, batch, self.vocab_size)
        return [shifted_logits(draft, batch, self.vocab_size)], [t_logits], [target_mask(batch)]

    def save(self, draft, out: Path, tokenizer, verifier: str) -> None:
        draft.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
