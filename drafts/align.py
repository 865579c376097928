"""How a draft's predictions line up with the target's, teacher-forced on token sequences.

Position t of a sequence predicts token t+1: the logits (or hidden states) at t are
compared with the target's at t, and the pair counts when token t+1 is a training target
(`target_mask`). An EAGLE-3 head's depth k adds k to that offset (drafts/eagle3/
`align_depths`).
"""

import torch


def shifted_logits(model, batch: dict, vocab_size: int) -> torch.Tensor:
    """Next-token logits at every position that predicts a later token: [batch, seq-1, vocab_size].

    `vocab_size` trims padded output heads (e.g. Qwen2.5 0.5B: 151936 vs 7B: 152064)
    to the ids the shared tokenizer can produce.
    """
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return out.logits[:, :-1, :vocab_size]


def shifted_hidden(model, batch: dict) -> torch.Tensor:
    """Final hidden states (after the last norm) at the positions of `shifted_logits`:
    [batch, seq-1, hidden]. The logits are computed for one position only."""
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        output_hidden_states=True,
        logits_to_keep=1,
    )
    return out.hidden_states[-1][:, :-1]


def target_mask(batch: dict) -> torch.Tensor:
    """Positions t whose next token t+1 is a training target: [batch, seq-1] bool."""
    return batch["loss_mask"][:, 1:] & batch["attention_mask"][:, 1:].bool()
