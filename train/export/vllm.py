"""vLLM: an EAGLE-3 head in the `speculators` layout; a standalone draft as a plain HF directory.

EAGLE-3 head (docs/theory.md §5): config.json with every field written explicitly
(`transformer_layer_config`, `draft_vocab_size`, `target_hidden_size`,
`eagle_aux_hidden_state_layer_ids`, `norm_before_residual`, the norm flags, and
`speculators_config` with the number of speculative tokens and the verifier's name_or_path
and architectures) and model.safetensors (fc, layers.0.*, norm, lm_head, embed_tokens,
d2t int64, t2d bool): what `Eagle3Head.save_pretrained` writes. `vllm serve OUT` alone starts
the verifier named in the config and proposes that many tokens.

Standalone draft: config.json, model.safetensors and the generation config of the causal LM,
which vLLM loads as a draft model path. SGLang and the hf format write the same directory.

Parallel draft (drafts/parallel/): the same causal-LM directory; its config.json keeps
`pard_token`, the mask token id that vLLM's parallel drafting (`"parallel_drafting": true`
with `"method": "draft_model"`) reads from the draft's config. Not an SGLang format.
"""

from pathlib import Path

from torch import nn

from specdistill.drafts.eagle3.head import Eagle3Head, check_vocab_map
from specdistill.models.weights import (
    BrokenWeightsError,
    IncompleteDraftError,
    NonFiniteWeightsError,
)
from specdistill.train.export import verifier
from specdistill.train.export.common import (
    ExportError,
    Options,
    Plan,
    check_head_files,
    config_of,
    speculative_tokens,
    weights_dtype,
)

# The serve hint's proposal length for a standalone draft (it records no training depth).
STANDALONE_TOKENS = 5


def write_head(head: Eagle3Head, options: Options) -> Plan:
    check_vocab_map(head.d2t, head.t2d, head.config.vocab_size, head.draft_vocab_size)
    name, archs, config = verifier.resolve(options.source, options.verifier)
    verifier.check_head(head, name, config)
    tokens = speculative_tokens(head, options)

    def write(out: Path) -> None:
        head.save_pretrained(out, verifier=name, verifier_arch=archs, speculative_tokens=tokens)
        vocab = config_of(out)["transformer_layer_config"]["vocab_size"]
        check_head_files(out, vocab, "layers.0.")

    return Plan(write, name, tokens)


def read_head(directory: Path) -> Eagle3Head:
    return Eagle3Head.from_pretrained(directory, dtype=weights_dtype(directory))


def write_causal_lm(model: nn.Module, options: Options) -> Plan:
    """Every format writes a standalone draft as this plain causal-LM directory."""
    name = verifier.warn_vocab(model, options.verifier)

    def write(out: Path) -> None:
        model.save_pretrained(str(out))
        if not any(out.glob("*.safetensors")):
            raise ExportError(f"export wrote no safetensors weights in {out}")

    return Plan(write, name, options.speculative_tokens or STANDALONE_TOKENS)


def read_causal_lm(directory: Path) -> nn.Module:
    """The causal LM of `directory` in its saved dtype, refused unless its weights cover its
    config and hold no NaN or infinity (models.hub.load_model: `IncompleteDraftError`,
    `BrokenWeightsError`, `NonFiniteWeightsError`)."""
    from specdistill.models import hub

    try:
        return hub.load_model(str(directory), dtype="auto")
    except (IncompleteDraftError, BrokenWeightsError, NonFiniteWeightsError):
        raise
    except (OSError, ValueError, KeyError) as e:
        raise ExportError(
            f"{directory} is neither an EAGLE-3 head directory nor a Hugging Face causal LM "
            f"directory that AutoModelForCausalLM can load: {e}"
        ) from e


def write_parallel_lm(model: nn.Module, options: Options) -> Plan:
    """A parallel draft: the plain causal-LM directory, whose config.json keeps `pard_token`
    (the mask token id vLLM's parallel drafting reads); the block length is
    --speculative-tokens, else the depths it was trained with."""
    from specdistill.drafts.parallel import DEPTHS_FIELD, mask_token

    if mask_token(model) is None:
        raise ExportError("a parallel draft's config.json must name its mask token (pard_token)")
    plan = write_causal_lm(model, options)
    trained = getattr(model.config, DEPTHS_FIELD, None) or STANDALONE_TOKENS
    return Plan(plan.write, plan.verifier, options.speculative_tokens or trained)


# keyed by a draft type's `capabilities.export_as`
WRITERS = {
    "eagle3_head": write_head,
    "causal_lm": write_causal_lm,
    "parallel_lm": write_parallel_lm,
}
READERS = {"eagle3_head": read_head, "causal_lm": read_causal_lm, "parallel_lm": read_causal_lm}
HINTS = {
    "eagle3_head": "vllm serve {target} --speculative-config "
    '\'{{"model": "{out}", "num_speculative_tokens": {tokens}, "method": "eagle3"}}\'',
    "causal_lm": "vllm serve {target} --speculative-config "
    '\'{{"model": "{out}", "num_speculative_tokens": {tokens}}}\'',
    "parallel_lm": "vllm serve {target} --speculative-config "
    '\'{{"model": "{out}", "num_speculative_tokens": {tokens}, "method": "draft_model", '
    '"parallel_drafting": true}}\'',
}
