"""A reduced-vocabulary draft written for the engines, which load a draft model only with the
target's whole output head (vLLM's `draft_model`, SGLang's `STANDALONE`).

The draft's forward gives −inf outside V_d (drafts/standalone/reduced_vocab.py). A plain Llama
causal LM has no bias in its output head, so the export cannot write −inf; it writes the K
trained rows of V_d where they belong and, in every other row, one vector −s·u, with u the
common direction of the draft's final hidden states h (their mean, normalised). The hidden
states of a causal LM have such a direction (its massive activations): every h has h·u > 0,
so every token outside V_d gets the logit −s·(h·u), far below V_d's, and the same at every
position. The V_d rows are the trained ones: the engine's argmax (its greedy proposals) is
the draft's, and its probabilistic proposals put no measurable mass outside V_d.

u and s come from the draft alone, on calibration text made of V_d tokens in a fixed random
order (`CALIBRATION` sequences): s puts the outside logit `MARGIN` nats below the largest V_d
logit seen there, twice over, because real text puts h nearer the boundary than random
tokens do. On the SmolLM2 hour's draft: h·u ≥ 11.4 on the calibration and ≥ 7.9 over 12,674
held-out chat positions, where the outside logits then lie ≥ 76 nats below V_d's best. An h
with h·u ≤ 0 would let the engine propose a token outside V_d: verification still keeps the
output exact (the engine verifies with the q it sampled from); only acceptance would fall.
A draft whose calibration states have no such direction is refused with the way out (the
`hf` export, or a draft trained with the full head).

Costs of the full head in the engine: the draft's output layer is V rows again (measured in
benchmarks/RESULTS.md, "vLLM decodes the drafts").
"""

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill.drafts.export import ExportError

CALIBRATION = (8, 128)  # sequences × tokens of V_d ids in a fixed random order
MARGIN = 30.0  # nats, on the calibration, between V_d's best logit and the outside logit
SAFETY = 2.0  # s is this multiple of what the calibration needs
_SEED = 0


@dataclass(frozen=True)
class OutsideRow:
    """The output-head row every token outside V_d gets: −scale·direction."""

    direction: Tensor  # u [H], unit norm
    scale: float  # s
    calibration_min: float  # min h·u over the calibration positions

    @property
    def row(self) -> Tensor:
        return -self.scale * self.direction


def outside_row(model) -> OutsideRow:
    """u and s for the reduced draft `model` (module docstring), from its calibration text."""
    head = model.lm_head
    ids = head.draft_ids().cpu()
    generator = torch.Generator().manual_seed(_SEED)
    tokens = ids[torch.randint(len(ids), CALIBRATION, generator=generator)]
    device = head.weight.device
    with torch.no_grad():
        hidden = model.model(input_ids=tokens.to(device)).last_hidden_state.float()
        hidden = hidden.reshape(-1, hidden.shape[-1])
        best = (hidden @ head.weight.float().T).max(dim=-1).values
    direction = hidden.mean(dim=0)
    direction = direction / direction.norm()
    along = hidden @ direction
    low = float(along.min())
    if not low > 0:
        raise ExportError(
            "this reduced-vocabulary draft's hidden states share no common direction "
            f"(min h·u {low:.3g} on its calibration text), so a full-vocabulary head cannot "
            "keep the tokens outside V_d below V_d's: export it as hf (specdistill serve / "
            "speculate load it), or train the draft with the full head (draft.vocab_size: null)"
        )
    scale = SAFETY * float(((best.max() + MARGIN) / low).clamp(min=1.0))
    return OutsideRow(direction.cpu(), scale, low)


def full_vocab_model(model) -> tuple[LlamaForCausalLM, OutsideRow]:
    """The plain Llama causal LM over the whole vocabulary that a reduced draft `model`
    becomes (module docstring), in the draft's dtype and device, and the row it used."""
    outside = outside_row(model)
    fields = model.config.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "draft_vocab_size"):
        fields.pop(key, None)
    fields["tie_word_embeddings"] = False
    config = LlamaConfig(**fields)
    config.architectures = [LlamaForCausalLM.__name__]
    weight = model.lm_head.weight.detach()
    full = outside.row.to(weight).expand(config.vocab_size, -1).clone()
    full[model.lm_head.draft_ids()] = weight
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("lm_head.")}
    out = LlamaForCausalLM(config).to(device=weight.device, dtype=weight.dtype)
    out.load_state_dict(state | {"lm_head.weight": full}, strict=True)
    out.generation_config = model.generation_config
    return out.eval(), outside
