"""The target's features an EAGLE-3 head drafts from: the hidden states entering chosen
decoder layers (`FeatureCapture`), and which layers by default (`default_aux_layers`).
"""

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from specdistill.errors import UserError


def decoder_layers(model) -> nn.ModuleList:
    """The decoder layers of a Llama- / Qwen2-style causal LM (peft-wrapped too)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(base.get_decoder(), "layers", None)
    if layers is None:
        raise UserError(f"cannot find decoder layers in {type(base).__name__}")
    return layers


def default_aux_layers(num_layers: int) -> list[int]:
    """Low, middle and high feature layers: vLLM's (2, L//2, L−3) where distinct, else spread."""
    if num_layers >= 7:
        return [2, num_layers // 2, num_layers - 3]
    if num_layers >= 4:
        return [1, num_layers // 2, num_layers - 1]
    raise UserError(
        f"automatic aux layers need a target with >= 4 layers (it has {num_layers}); "
        "set draft.aux_layers"
    )


class FeatureCapture:
    """Capture the hidden states entering the given decoder layers during a target forward.

    Layer id i is the residual stream *entering* layer i (HF `hidden_states[i]`; vLLM's
    `eagle_aux_hidden_state_layer_ids` convention). The capture happens inside the forward
    that computes the target's logits: no second pass.

        with FeatureCapture(target, [1, 2, 3]) as cap:
            logits = target(input_ids).logits
        features = cap.features()  # [B, T, 3·H_t]
    """

    def __init__(self, model, layer_ids: Sequence[int]):
        layers = decoder_layers(model)
        for i in layer_ids:
            if not 0 <= i < len(layers):
                raise UserError(f"aux layer {i} out of range for a {len(layers)}-layer target")
        self.layers, self.layer_ids = layers, list(layer_ids)
        self._captured: dict[int, Tensor] = {}
        self._handles = []

    def __enter__(self):
        for i in dict.fromkeys(self.layer_ids):
            self._handles.append(
                self.layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True)
            )
        return self

    def _hook(self, i: int):
        def hook(module, args, kwargs):
            self._captured[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    def record(self, i: int, hidden: Tensor) -> None:
        """Store the hidden states entering layer i if it is captured. For forwards that do not
        call the layer modules, so hooks cannot see them (models/lean.py)."""
        if i in self.layer_ids:
            self._captured[i] = hidden

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def features(self) -> Tensor:
        missing = [i for i in self.layer_ids if i not in self._captured]
        if missing:
            raise RuntimeError(f"no hidden states captured for layers {missing}; run a forward")
        out = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        self._captured = {}
        return out


# ----------------------------------------------------------------------------- the head
