"""α drift scoring: each target's responses and one prompt's teacher-forced α sums.

`generate_responses` answers the prompts with a target alone (the project's engine);
`score_prompt` compares the draft with both targets on both responses of a prompt and
returns its `PromptScore` (sums per depth), which eval/drift.py `summarise` turns into the
report (the meanings: eval/drift_cli.py's module docstring).
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specdistill import drafts, losses
from specdistill.eval import engine
from specdistill.eval.sampling import is_greedy
from specdistill.losses.sampling import probabilities
from specdistill.models.kv_cache import eval_mode


@dataclass
class PromptScore:
    """Sums over one prompt's scored positions. Arrays are [K, 3] per depth: (Σ α at the
    serving temperature, Σ α at T = 0, n positions)."""

    category: str | None
    before: np.ndarray  # draft vs before-target, on the before-target's response
    after: np.ndarray  # draft vs after-target, on the after-target's response
    cross: np.ndarray  # draft vs before-target, on the after-target's response
    tv: np.ndarray = field(default_factory=lambda: np.zeros(3))  # (Σ TV, Σ argmax differ, n)


def _depth_alphas(kind, target, draft, ids, n_prompt, n_out, depth, vocab_size, sampling):
    """Per depth: (α_T [n_out], α_0 [n_out], valid [n_out], target logits [n_out, V])."""
    temperature, top_p, top_k = sampling

    out = []
    for d_logits, t_logits, mask in kind.path_logits(
        target, draft, ids, n_prompt, depth, vocab_size
    ):
        d_logits, t_logits = d_logits[:n_out].float(), t_logits[:n_out].float()
        valid = (
            torch.ones(n_out, dtype=torch.bool, device=t_logits.device)
            if mask is None
            else mask[:n_out].to(t_logits.device)
        )
        if not is_greedy(temperature):  # 1e-300 would overflow the logits: greedy
            a_t = losses.acceptance(
                d_logits, t_logits, temperature, valid, top_p=top_p, top_k=top_k
            )
        else:
            a_t = losses.acceptance(d_logits, t_logits, 0.0, valid)
        a_0 = losses.acceptance(d_logits, t_logits, 0.0, valid)
        out.append((a_t, a_0, valid, t_logits))
    return out


def _sums(depths) -> np.ndarray:
    return np.array(
        [[float(a_t.sum()), float(a_0.sum()), float(valid.sum())] for a_t, a_0, valid, _ in depths]
    )


@torch.inference_mode()
def score_prompt(
    target_before,
    target_after,
    draft,
    prompt: Sequence[int],
    out_before: Sequence[int],
    out_after: Sequence[int],
    *,
    temperature: float,
    top_p: float | None = None,
    top_k: int | None = None,
    depth: int = 1,
    vocab_size: int,
    category: str | None = None,
    token_loss: dict | None = None,
) -> PromptScore:
    """Teacher-forced α of `draft` against both targets on both responses of one prompt.

    `token_loss` (token id -> [Σ (α_before − α_after), count]) is updated with the
    after-text positions, grouped by the after-target's argmax.
    """
    kind = drafts.type_of(draft)
    sampling = (temperature, top_p, top_k)
    device = next(target_after.parameters()).device
    k = depth if kind.per_depth_alpha else 1
    empty = np.zeros((k, 3))
    with eval_mode(target_before, target_after, draft):
        before = empty.copy()
        if out_before:
            ids = torch.tensor([list(prompt) + list(out_before)], device=device)
            before = _sums(
                _depth_alphas(
                    kind,
                    target_before,
                    draft,
                    ids,
                    len(prompt),
                    len(out_before),
                    k,
                    vocab_size,
                    sampling,
                )
            )
        after, cross, tv = empty.copy(), empty.copy(), np.zeros(3)
        if out_after:
            ids = torch.tensor([list(prompt) + list(out_after)], device=device)
            args = (ids, len(prompt), len(out_after), k, vocab_size, sampling)
            on_after = _depth_alphas(kind, target_after, draft, *args)
            on_cross = _depth_alphas(kind, target_before, draft, *args)
            after, cross = _sums(on_after), _sums(on_cross)
            a_t, _, valid, logits_a = on_after[0]
            b_t, _, valid_b, logits_b = on_cross[0]
            valid = valid & valid_b
            tv_temp = temperature if temperature > 0 else 1.0
            p_a = probabilities(logits_a, tv_temp, top_p, top_k)
            p_b = probabilities(logits_b.to(logits_a.device), tv_temp, top_p, top_k)
            tv_pos = 0.5 * (p_a - p_b).abs().sum(-1)
            differ = (logits_a.argmax(-1) != logits_b.argmax(-1)).float()
            tv = np.array(
                [float(tv_pos[valid].sum()), float(differ[valid].sum()), float(valid.sum())]
            )
            if token_loss is not None:
                argmax = logits_a.argmax(-1)[valid].tolist()
                loss = (b_t - a_t)[valid].tolist()
                for tok, value in zip(argmax, loss, strict=True):
                    entry = token_loss.setdefault(tok, [0.0, 0])
                    entry[0] += value
                    entry[1] += 1
    return PromptScore(category, before, after, cross, tv)


def generate_responses(
    target,
    prompt_ids: list[list[int]],
    *,
    temperature: float,
    top_p: float | None = None,
    top_k: int | None = None,
    max_new_tokens: int = 128,
    eos_token_id: int | None = None,
    seed: int = 0,
    batch_size: int = 8,
) -> list[list[int]]:
    """Each prompt's response by `target` alone (the project's engine, no draft)."""
    gen = engine.generate(
        target,
        None,
        prompt_ids,
        temperature=temperature,
        top_p=top_p if temperature > 0 else None,
        top_k=top_k if temperature > 0 else None,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        seed=seed,
        batch_size=batch_size,
    )
    return [list(s) for s in gen.sequences]
