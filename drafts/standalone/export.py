"""The standalone draft's export: a plain Hugging Face causal-LM directory, in every format.

config.json, model.safetensors and the generation config of the causal LM, which vLLM loads
as a draft model path and SGLang as its STANDALONE draft; the hf format writes the same
directory (a saved standalone draft is already in it: `Standalone.layout`). The parallel type
(drafts/parallel/) writes this directory too, with its mask token in config.json.
"""

import sys
from pathlib import Path

from torch import nn

from specdistill.drafts import verifier
from specdistill.drafts.export import ExportError, Options, Plan
from specdistill.drafts.standalone.full_vocab import full_vocab_model
from specdistill.models import hub
from specdistill.models.weights import (
    BrokenWeightsError,
    IncompleteDraftError,
    NonFiniteWeightsError,
)

# The serve hint's proposal length for a standalone draft (it records no training depth).
STANDALONE_TOKENS = 5
VLLM_HINT = (
    "vllm serve {target} --speculative-config "
    '\'{{"model": "{out}", "num_speculative_tokens": {tokens}}}\''
)
SGLANG_HINT = (
    "python -m sglang.launch_server --model-path {target} "
    "--speculative-algorithm STANDALONE --speculative-draft-model-path {out} "
    "--speculative-num-steps {tokens} --speculative-eagle-topk 1 "
    "--speculative-num-draft-tokens {draft_tokens}"
)


def warn_vocab(model, name: str | None) -> str | None:
    """Warn when a given verifier's vocabulary differs from the draft's; -> its name."""
    if name is None:
        return None
    resolved = verifier.resolve_name(name)
    theirs = (verifier.verifier_config(resolved) or {}).get("vocab_size")
    ours = getattr(model.config, "vocab_size", None)
    if theirs is not None and ours is not None and theirs != ours:
        print(
            f"warning: draft vocab_size {ours} differs from verifier {name}'s "
            f"{theirs}; engines need draft and target to share the tokenizer",
            file=sys.stderr,
        )
    return resolved


def write_causal_lm(model: nn.Module, options: Options) -> Plan:
    """Every format writes a standalone draft as this plain causal-LM directory."""
    name = warn_vocab(model, options.verifier)
    return Plan(
        lambda out: save_causal_lm(model, out),
        name,
        options.speculative_tokens or STANDALONE_TOKENS,
    )


def save_causal_lm(model: nn.Module, out: Path) -> None:
    """`model` saved into `out`; ExportError when no safetensors weights were written."""
    model.save_pretrained(str(out))
    if not any(out.glob("*.safetensors")):
        raise ExportError(f"export wrote no safetensors weights in {out}")


def write_full_vocab(model: nn.Module, options: Options) -> Plan:
    """A reduced-vocabulary draft for vLLM or SGLang: the plain causal LM over the whole
    vocabulary that it becomes (full_vocab.py), made when the plan is written."""
    name = warn_vocab(model, options.verifier)
    return Plan(
        lambda out: save_causal_lm(full_vocab_model(model), out),
        name,
        options.speculative_tokens or STANDALONE_TOKENS,
    )


def read_causal_lm(directory: Path) -> nn.Module:
    """The causal LM of `directory` in its saved dtype, refused unless its weights cover its
    config and hold no NaN or infinity (models.hub.load_model: `IncompleteDraftError`,
    `BrokenWeightsError`, `NonFiniteWeightsError`)."""
    try:
        return hub.load_model(str(directory), dtype="auto")
    except (IncompleteDraftError, BrokenWeightsError, NonFiniteWeightsError):
        raise
    except (OSError, ValueError, KeyError) as e:
        raise ExportError(
            f"{directory} is neither an EAGLE-3 head directory nor a Hugging Face causal LM "
            f"directory that AutoModelForCausalLM can load: {e}"
        ) from e
