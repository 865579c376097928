"""A reduced-vocabulary draft written for the engines, which load a draft model only with the
target's whole output head (vLLM's `draft_model`, SGLang's `STANDALONE`).

The draft's forward gives −inf outside V_d (drafts/standalone/reduced_vocab.py). A plain Llama
causal LM has no bias in its output head, so the export cannot write −inf: it writes the K
trained rows of V_d where they belong and zeros in every other row, so every token outside
V_d gets the logit 0. Wherever the draft's best V_d logit is positive, the engine's argmax is
the draft's own: its greedy proposals, which is what vLLM proposes at every temperature by
default (`draft_sample_method="greedy"`), and SGLang too. A trained head's best logit is
large: over 6,778 held-out chat positions the SmolLM2 drafts' lowest was 1.7 (the hour's) and
2.4 (4,000 answers'); the export reports the lowest on its calibration text (V_d tokens in a
fixed random order) and warns when one is not positive.

Sampled proposals (vLLM's `draft_sample_method="probabilistic"`) are another matter: the
|V| − K zero logits hold real mass (0.62 of it on average for the hour's draft at T = 1), so
the engine then proposes tokens the draft never would, verified and mostly rejected. The
output stays exact; the acceptance falls. A row −s·u along the hidden states' common
direction would push them down, but a causal LM's states need not have one (the 4,000-answer
draft's point every way on real text): the zeros are the export that is right for greedy
proposals whatever the draft. For sampled proposals, train the draft with the full head
(draft.vocab_size: null). Costs of the full head in the engine: benchmarks/RESULTS.md, "vLLM
decodes the drafts".
"""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

CALIBRATION = (8, 128)  # sequences × tokens of V_d ids in a fixed random order
_SEED = 0


def lowest_best_logit(model) -> float:
    """The lowest, over the calibration positions, of the reduced draft's best V_d logit."""
    ids = model.lm_head.draft_ids().cpu()
    generator = torch.Generator().manual_seed(_SEED)
    tokens = ids[torch.randint(len(ids), CALIBRATION, generator=generator)]
    with torch.no_grad():
        logits = model(input_ids=tokens.to(model.lm_head.weight.device), full_vocab=False).logits
    return float(logits.float().max(dim=-1).values.min())


def full_vocab_model(model) -> LlamaForCausalLM:
    """The plain Llama causal LM over the whole vocabulary that a reduced draft `model`
    becomes (module docstring), in the draft's dtype and device."""
    lowest = lowest_best_logit(model)
    print(
        f"note: the reduced output head ({model.config.draft_vocab_size} rows) is written over "
        f"the whole vocabulary ({model.config.vocab_size} rows) for the engine, the tokens "
        f"outside it at logit 0: the engine's greedy proposals are the draft's wherever its "
        f"best logit is positive (lowest on the calibration text: {lowest:.3g}); sampled "
        "proposals are not (drafts/standalone/full_vocab.py)",
        file=sys.stderr,
    )
    if not lowest > 0:
        print(
            "warning: the draft's best logit is not positive everywhere on the calibration "
            "text: there the engine proposes a token outside V_d, which verification rejects",
            file=sys.stderr,
        )
    fields = model.config.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "draft_vocab_size"):
        fields.pop(key, None)
    fields["tie_word_embeddings"] = False
    config = LlamaConfig(**fields)
    config.architectures = [LlamaForCausalLM.__name__]
    weight = model.lm_head.weight.detach()
    full = weight.new_zeros(config.vocab_size, weight.shape[1])
    full[model.lm_head.draft_ids()] = weight
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("lm_head.")}
    out = LlamaForCausalLM(config).to(device=weight.device, dtype=weight.dtype)
    out.load_state_dict(state | {"lm_head.weight": full}, strict=True)
    out.generation_config = model.generation_config
    return out.eval()
