"""The predicted acceptance of a proposed draft token: what the engine's draft-length policy
(eval/length_policy.py) reads after every draft step.

One function, `predicted_acceptance`. With an acceptance head on the draft module
(`model.acceptance_head`, drafts/acceptance_head.py: the hidden state the draft's output head
reads [B, H] and the draft's logits -> a probability), the prediction is the head's. Without
one, it is the draft's own probability of the token it proposed (the confidence proxy of
EAGLE-2 and SpecDec++'s baseline): q(token) under the temperature-scaled distribution it was
drawn from, or, for a greedy row (whose q is a point mass), the token's probability under
softmax(draft logits).
"""

import torch
from torch import Tensor


def acceptance_head(model):
    """The draft module's acceptance head, or None."""
    return getattr(model, "acceptance_head", None)


def predicted_acceptance(
    model, logits: Tensor, tokens: Tensor, probs: Tensor | None = None, hidden: Tensor | None = None
) -> Tensor:
    """Per row, the predicted probability that the target accepts `tokens`: [B] in [0, 1].

    logits [B, V]: the draft's logits the tokens [B] were chosen from; probs [B, V]: the
    distribution each was drawn from (None, or an all-zero row, when greedy); hidden [B, H]:
    the draft's last hidden state (needed only when the draft has an acceptance head).
    """
    head = acceptance_head(model)
    if head is not None and hidden is not None:  # drafts/acceptance_head.py AcceptanceHead
        return head.predict_rows(hidden, logits)
    own = logits.float().softmax(-1).gather(-1, tokens[:, None])[:, 0]
    if probs is None:
        return own
    drawn = probs.gather(-1, tokens[:, None])[:, 0].float()
    return torch.where(drawn > 0, drawn, own)
