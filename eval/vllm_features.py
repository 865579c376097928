"""A target's hidden states from vLLM: the residual stream entering chosen decoder layers at
every position of each sequence, from one prefill, as an EAGLE-3 head reads them.

vLLM's `extract_hidden_states` method (a speculative method that proposes nothing: it
stores the target's auxiliary hidden states in a cache of their own) and a hidden-states
connector that writes each finished request's to a file. The layer ids are vLLM's
`eagle_aux_hidden_state_layer_ids`, the convention of `drafts.eagle3.features`: layer i is
the residual stream entering layer i, and i = the number of layers is the last layer's output
before the final norm. On a CPU the connector is the project's (eval/vllm_hidden_connector.py:
vLLM's own writes through CUDA). Each sequence is prefilled with one token generated, so its
hidden states cover every position of the sequence given.

    features = VllmFeatures(model_dir, [2, 15, 27], VllmSettings(dtype="bfloat16"))
    rows = features.hidden_states([[1, 2, 3], [4, 5]])  # [3, 3·H], [2, 3·H], float32
    features.close()
"""

import os
import shutil
import tempfile
from collections.abc import Sequence

import torch
from safetensors.torch import load_file

from specdistill.eval.vllm_engine import (
    VllmError,
    VllmSettings,
    release,
    start_llm,
    vllm_version,
)

CONNECTOR = "CpuHiddenStatesConnector"
CONNECTOR_MODULE = "specdistill.eval.vllm_hidden_connector"


class VllmFeatures:
    """vLLM's `LLM` over `model`, set up to return the hidden states entering `layers`."""

    def __init__(self, model: str, layers: Sequence[int], settings: VllmSettings):
        if not layers:
            raise VllmError("hidden states need at least one layer id")
        self.layers = [int(i) for i in layers]
        self.description = f"vllm {vllm_version()} prefill ({settings.dtype}, {settings.mode})"
        self.dir = tempfile.mkdtemp(prefix="specdistill-hidden-")
        self.vllm, self.llm = start_llm(
            model,
            settings,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {
                    "hf_config": {"eagle_aux_hidden_state_layer_ids": self.layers}
                },
            },
            kv_transfer_config={
                "kv_connector": CONNECTOR,
                "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": self.dir},
            },
        )

    def hidden_states(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per sequence, float32 [len, len(layers) · hidden]: the layers' hidden states side
        by side, in the order given."""
        if any(len(s) == 0 for s in sequences):
            raise VllmError("hidden states of an empty sequence were asked")
        for stale in os.listdir(self.dir):  # a previous call's one-token request, written late
            os.remove(os.path.join(self.dir, stale))
        paths = self._prefill(sequences)
        if not all(os.path.exists(p) for p in paths):
            # a finished request's states are written at vLLM's next step: one token drives it
            self._prefill([[int(sequences[0][0])]])
        return [self._read(path, seq) for path, seq in zip(paths, sequences, strict=True)]

    def _prefill(self, sequences) -> list[str]:
        """Each sequence prefilled with one greedy token generated; its hidden states' path."""
        params = self.vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        inputs = [self.vllm.TokensPrompt(prompt_token_ids=list(map(int, s))) for s in sequences]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        paths = []
        for out in outputs:
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise VllmError("vLLM returned no hidden states for a sequence")
            paths.append(path)
        return paths

    def _read(self, path: str, sequence: Sequence[int]) -> torch.Tensor:
        if not os.path.exists(path):
            raise VllmError(f"vLLM wrote no hidden states to {path}")
        stored = load_file(path)
        for name in (path, path + ".lock"):
            if os.path.exists(name):
                os.remove(name)
        ids = stored["token_ids"].tolist()
        if ids != list(map(int, sequence)):
            raise VllmError(f"vLLM's hidden states are for other tokens ({len(ids)} ids)")
        states = stored["hidden_states"]  # [len, layers, hidden]
        if states.shape[0] != len(ids) or states.shape[1] != len(self.layers):
            raise VllmError(f"vLLM's hidden states have shape {tuple(states.shape)}")
        return states.reshape(len(ids), -1).float()

    def close(self) -> None:
        """Let vLLM's engine go and remove its files; the object is unusable after."""
        release(self)
        shutil.rmtree(self.dir, ignore_errors=True)
