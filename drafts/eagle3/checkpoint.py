"""An EAGLE-3 head on disk: the `speculators` layout vLLM loads (config.json +
model.safetensors, docs/theory.md §5), and the checks that recognise a head's directory
(speculators or SGLang layout). `Eagle3Head.save_pretrained` / `from_pretrained` /
`load_checked` call these functions; `from_pretrained` takes the head class.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor
from transformers import LlamaConfig

from specdistill.drafts.registry import read_config
from specdistill.drafts.vocab_map import check_vocab_map
from specdistill.errors import UserError
from specdistill.models.weights import IncompleteDraftError, describe, read_safetensors

SPECULATORS_VERSION = "0.9.0"  # the format version written (and tested in tests/interop)
# speculative_tokens written for a head whose training depth is unknown (vLLM's proposal length)
DEFAULT_SPECULATIVE_TOKENS = 3
SGLANG_ARCH = "LlamaForCausalLMEagle3"  # SGLang's EAGLE-3 head class (an SGLang export's config)


def speculators_config(
    head, verifier: str | None = None, verifier_arch=None, speculative_tokens: int | None = None
) -> dict:
    """The speculators config.json. `speculative_tokens` (the proposal length vLLM uses by
    default) defaults to the head's training depth, else `DEFAULT_SPECULATIVE_TOKENS`."""
    if speculative_tokens is None:
        speculative_tokens = head.ttt_steps or DEFAULT_SPECULATIVE_TOKENS
    layer_config = head.config.to_dict()
    layer_config["architectures"] = ["LlamaForCausalLM"]
    # Our own key (the package's config classes accept unknown keys; vLLM ignores it).
    depth = {} if head.ttt_steps is None else {"ttt_steps": head.ttt_steps}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_config,
        "draft_vocab_size": head.draft_vocab_size,
        "target_hidden_size": head.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": head.aux_layers,
        "norm_before_residual": head.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "has_no_defaults_at_init": False,
        "dtype": str(head.fc.weight.dtype).removeprefix("torch."),
        "torch_dtype": str(head.fc.weight.dtype).removeprefix("torch."),
        **depth,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier,
                "architectures": list(verifier_arch or []),
            },
        },
    }


def save_pretrained(
    head,
    directory,
    *,
    verifier: str | None = None,
    verifier_arch=None,
    speculative_tokens: int | None = None,
):
    """config.json + model.safetensors in the speculators layout (docs/theory.md §5)."""
    check_vocab_map(head.d2t, head.t2d, head.config.vocab_size, head.draft_vocab_size)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = speculators_config(head, verifier, verifier_arch, speculative_tokens)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def head_from_config(cls, config: dict):
    """An untrained head `cls` of a speculators Eagle-3 config.json's fields (built on the
    caller's device context: on "meta" it allocates nothing)."""
    layer = {k: v for k, v in config["transformer_layer_config"].items() if k != "model_type"}
    return cls(
        LlamaConfig(**layer),
        draft_vocab_size=config["draft_vocab_size"],
        target_hidden_size=config["target_hidden_size"],
        aux_layers=config["eagle_aux_hidden_state_layer_ids"],
        norm_before_residual=config["norm_before_residual"],
        ttt_steps=config.get("ttt_steps"),
    )


def from_pretrained(cls, directory, dtype: torch.dtype | None = None):
    """Load a head saved by `save_pretrained` (or any speculators Eagle-3 checkpoint)."""
    directory = Path(directory)
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not an EAGLE-3 checkpoint directory")
    config = json.loads(path.read_text())
    if config.get("speculators_model_type") != "eagle3":
        raise UserError(
            f"{path}: speculators_model_type is {config.get('speculators_model_type')!r}, "
            "expected 'eagle3'"
        )
    head = head_from_config(cls, config)
    weights = directory / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} not found: the head's weights are missing")
    head.load_checked(read_safetensors(weights), str(directory))
    return head.to(dtype) if dtype is not None else head


def load_checked(head, state: dict[str, Tensor], source: str) -> None:
    """Load a full state dict, all or nothing: the vocabulary map is checked first, then
    names and shapes must match the head its config describes (`IncompleteDraftError`
    naming the tensors otherwise; nothing is loaded)."""
    check_vocab_map(
        state.get("d2t"), state.get("t2d"), head.config.vocab_size, head.draft_vocab_size
    )
    ours = head.state_dict()
    mismatched = [
        f"{name} {tuple(state[name].shape)} vs {tuple(ours[name].shape)}"
        for name in ours
        if name in state and state[name].shape != ours[name].shape
    ]
    message = describe(
        source,
        missing=[name for name in ours if name not in state],
        unexpected=[name for name in state if name not in ours],
        mismatched=mismatched,
    )
    if message:
        raise IncompleteDraftError(message)
    head.load_state_dict(state)


def is_eagle3_dir(path) -> bool:
    """A head in the speculators layout (`save_pretrained`; vLLM and HF exports)."""
    return (read_config(path) or {}).get("speculators_model_type") == "eagle3"


def is_sglang_eagle3_dir(path) -> bool:
    """A head in SGLang's LlamaForCausalLMEagle3 layout (an SGLang export)."""
    return SGLANG_ARCH in ((read_config(path) or {}).get("architectures") or [])
