"""Run in a subprocess by tests/eval/test_vllm_features.py (vLLM runs in its process and binds
its threads): the hidden states vLLM returns (eval/vllm_features.py) against those of a
transformers forward of the same model.

    python -m tests.eval.vllm_hidden MODEL_DIR

prints one JSON line: per asked layer, the largest absolute difference to the transformers
forward over every position of every sequence, the largest magnitude, the shapes, and whether
a second call (fewer sequences) returns the same rows.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from specdistill.drafts.eagle3.features import FeatureCapture, decoder_layers
from specdistill.eval.vllm_engine import VllmSettings
from specdistill.eval.vllm_features import VllmFeatures

SEQUENCES = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], list(range(20, 80)), [30]]


def main(model_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n_layers = len(decoder_layers(model))
    layers = [1, n_layers - 1, n_layers]  # n_layers: the last layer's output, before the norm
    engine = VllmFeatures(model_dir, layers, VllmSettings(kv_cache_gib=1, max_num_seqs=4))
    rows = engine.hidden_states(SEQUENCES)
    again = engine.hidden_states(SEQUENCES[2:3])
    engine.close()
    final = {}
    model.model.norm.register_forward_pre_hook(lambda _m, args: final.update(h=args[0]))
    width = model.config.hidden_size
    diff, scale = [0.0] * len(layers), 0.0
    for ids, got in zip(SEQUENCES, rows, strict=True):
        with torch.no_grad(), FeatureCapture(model, layers[:-1]) as capture:
            model(torch.tensor([ids]))
        want = torch.cat([capture.features()[0], final["h"][0]], dim=-1)
        scale = max(scale, want.abs().max().item())
        for k in range(len(layers)):
            part = slice(k * width, (k + 1) * width)
            diff[k] = max(diff[k], (got[:, part] - want[:, part]).abs().max().item())
    result = {
        "diff": diff,
        "scale": scale,
        "shapes": [list(r.shape) for r in rows],
        "width": width * len(layers),
        "again": (again[0] - rows[2]).abs().max().item(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
