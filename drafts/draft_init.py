"""A standalone draft initialised from its target: some of the target's own layers.

`draft_from_target(target, layers)` builds a causal LM of the target's architecture (its
class and config, with `num_hidden_layers` = len(layers)) holding the target's embeddings,
the chosen decoder layers' weights (in the order given, renumbered 0..n−1), its final norm
and its output head (tied to the embeddings when the target's is). A draft made of all the
target's layers is the target (tests/drafts/test_draft_init.py). `init_from_target` writes
such a draft as a Hugging Face model directory with the target's tokenizer; a recipe asks
for one with `draft.model: target-layers:...` (`layers_spec`; drafts/standalone/
`load_or_init`).

Layers are given as indices (`[0, 15, 29]`, in a recipe `target-layers:0,15,29`) or as a
number N, the target's first N layers (`choose_layers`; in a recipe `target-layers:4`): an
early exit, the one initialisation that starts from a working model. On SmolLM2-135M-Instruct
the first 2 layers under the target's final norm and head agree with it on α 0.06 of its
greedy answer, while layers 0 and 29 give α 0.0001: a model's last layer expects the
residual stream its middle layers build (benchmarks/RESULTS.md, "A real target"). The copy
needs the
decoder layers as `model.layers.<i>.` in the state dict (the Llama family: llama, mistral,
qwen2, qwen3) and a target without a peft adapter (merge it first).
"""

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdistill.errors import UserError

LAYER_PREFIX = "model.layers."
SPEC_PREFIX = "target-layers:"  # draft.model: target-layers:N or target-layers:0,15,29


class DraftInitError(UserError):
    """A draft cannot be made of the target's layers as asked."""


@dataclass(frozen=True)
class TargetLayers:
    """The target's decoder layers a draft is made of: `indices` into the target's
    `n_layers`, strictly increasing."""

    indices: tuple[int, ...]
    n_layers: int

    def __post_init__(self):
        bad = [i for i in self.indices if not 0 <= i < self.n_layers]
        if bad:
            raise DraftInitError(
                f"target layers: layer {bad[0]} is out of range: the target has "
                f"{self.n_layers} layers (0..{self.n_layers - 1})"
            )
        if not self.indices:
            raise DraftInitError("target layers: name at least one layer")
        if any(b <= a for a, b in zip(self.indices, self.indices[1:], strict=False)):
            raise DraftInitError(
                f"target layers: {list(self.indices)} must be distinct and increasing"
            )

    def source(self, name: str) -> str | None:
        """The target state-dict name a draft tensor `name` is copied from (None: the
        draft has no such tensor)."""
        if not name.startswith(LAYER_PREFIX):
            return name
        index, rest = name[len(LAYER_PREFIX) :].split(".", 1)
        return f"{LAYER_PREFIX}{self.indices[int(index)]}.{rest}"


def layers_spec(model: str | None) -> int | list[int] | None:
    """The layers a recipe's `draft.model` names with `target-layers:N` (the first N layers)
    or `target-layers:0,15,29` (indices); None for any other model name."""
    if model is None or not model.startswith(SPEC_PREFIX):
        return None
    text = model[len(SPEC_PREFIX) :].strip()
    try:
        if "," in text or text.startswith("["):
            return [int(x) for x in text.strip("[]").split(",") if x.strip()]
        return int(text)
    except ValueError:
        raise DraftInitError(
            f"draft.model {model!r}: write {SPEC_PREFIX}N (the target's first N layers) or "
            f"{SPEC_PREFIX}0,15,29 (those layers)"
        ) from None


def choose_layers(spec: int | Sequence[int], n_layers: int) -> TargetLayers:
    """`spec` as the recipe writes it: a number N (the target's first N layers: an early
    exit), or the layer indices themselves."""
    if isinstance(spec, int):
        if not 1 <= spec <= n_layers:
            raise DraftInitError(
                f"target layers: {spec} layers asked of a target with {n_layers}: give "
                f"1 to {n_layers}, or the layer indices"
            )
        return TargetLayers(tuple(range(spec)), n_layers)
    return TargetLayers(tuple(int(i) for i in spec), n_layers)


def draft_from_target(target, layers: TargetLayers | int | Sequence[int]):
    """A draft of the target's class made of its `layers` (module docstring); in the
    target's dtype, on the CPU, in eval mode, sharing no tensor with the target."""
    if hasattr(target, "peft_config"):
        raise DraftInitError(
            "target layers: the target carries a peft adapter; initialise the draft from "
            "a merged model (merge_and_unload, saved) instead"
        )
    n_layers = target.config.num_hidden_layers
    if not isinstance(layers, TargetLayers):
        layers = choose_layers(layers, n_layers)
    state = target.state_dict()
    if not any(name.startswith(LAYER_PREFIX) for name in state):
        raise DraftInitError(
            f"target layers: the target ({type(target).__name__}) keeps no decoder "
            f"layers as {LAYER_PREFIX}<i>; a Llama-family target is needed"
        )
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers.indices)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers.indices]
    dtype = target.get_input_embeddings().weight.dtype
    draft = type(target)(config).to(dtype)
    wanted = {name: state[layers.source(name)] for name in draft.state_dict()}
    draft.load_state_dict(wanted, strict=True)  # copies
    draft.generation_config = copy.deepcopy(target.generation_config)
    draft.name_or_path = f"{target.name_or_path} layers {list(layers.indices)}"
    return draft.eval()


def init_from_target(target, tokenizer, layers: TargetLayers | int | Sequence[int], out) -> Path:
    """Write `draft_from_target(target, layers)` and the target's tokenizer to the
    directory `out` (a Hugging Face model directory any loader of the project reads)."""
    out = Path(out)
    draft = draft_from_target(target, layers)
    with torch.no_grad():
        draft.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
