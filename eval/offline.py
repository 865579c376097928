"""Offline acceptance: α of a draft against its target on held-out token sequences.

α per position is Σ_x min(p(x), q(x)) at the verifier's temperature (REFERENCE §1);
at temperature 0 it is argmax agreement. The predicted accepted length per round for a
draft of γ tokens, with i.i.d. acceptance α, is τ(γ) = (1 − α^(γ+1)) / (1 − α),
bonus token included, so τ ∈ [1, γ + 1].
"""

from collections.abc import Iterable

import torch

import losses


def tau_pred(alpha: float, gamma: int) -> float:
    """Expected tokens per verification round for i.i.d. acceptance `alpha` (bonus included)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


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


@torch.no_grad()
def acceptance_sums(
    target, draft, batches: Iterable[dict], *, vocab_size: int, temperature: float
) -> torch.Tensor:
    """Sums over valid positions: tensor([Σ α_T, Σ α_greedy, n_positions]) in float64.

    Returned as sums so that callers running on several processes can all-reduce them.
    """
    sums = torch.zeros(3, dtype=torch.float64)
    for batch in batches:
        mask = target_mask(batch)
        t_logits = shifted_logits(target, batch, vocab_size)
        d_logits = shifted_logits(draft, batch, vocab_size)
        alpha = losses.acceptance(d_logits, t_logits, temperature=temperature)
        greedy = losses.acceptance(d_logits, t_logits, temperature=0.0)
        sums[0] += alpha[mask].double().sum().cpu()
        sums[1] += greedy[mask].double().sum().cpu()
        sums[2] += mask.sum().cpu()
    return sums


def summarise(sums: torch.Tensor, *, temperature: float, max_gamma: int) -> dict:
    """Turn `acceptance_sums` (possibly all-reduced) into the reported metrics."""
    n = int(sums[2].item())
    if n == 0:
        raise ValueError("no valid positions in the evaluation data (empty loss mask)")
    alpha = float(sums[0] / n)
    return {
        "alpha": alpha,
        "alpha_greedy": float(sums[1] / n),
        "temperature": temperature,
        "n_positions": n,
        "tau_pred": {g: tau_pred(alpha, g) for g in range(1, max_gamma + 1)},
    }
