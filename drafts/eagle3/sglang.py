"""The EAGLE-3 head's export for SGLang (format sglang): `LlamaForCausalLMEagle3`.

config.json with architectures ["LlamaForCausalLMEagle3"], model_type "llama",
the decoder layer's Llama fields (num_hidden_layers 1, tie_word_embeddings false),
`draft_vocab_size`, `target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`
(and our `ttt_steps`, the training depth, when the head records it); weights fc.weight,
midlayer.*, norm.weight, lm_head.weight, embed_tokens.weight, d2t, t2d (`layers.0.` renamed
`midlayer.`). SGLang's config has no verifier field: a --verifier is only checked.

SGLang's layer always adds the residual before the norm, takes exactly three feature layers,
and counts a feature layer as the *output* of layer i (it captures the stream entering layer
i + 1), while this project and vLLM name the layer the stream enters: the ids written are
ours minus one (`read_head` adds it back). A head trained with norm_before_residual=True, or
with another number of feature layers, is refused.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from specdistill.drafts.eagle3.export import check_given, check_head_files, speculative_tokens
from specdistill.drafts.eagle3.head import SGLANG_ARCH, Eagle3Head, check_vocab_map
from specdistill.drafts.export import WEIGHTS, ExportError, Options, Plan, config_of, weights_dtype
from specdistill.models.weights import read_safetensors

HINT = (
    "python -m sglang.launch_server --model-path {target} "
    "--speculative-algorithm EAGLE3 --speculative-draft-model-path {out} "
    "--speculative-num-steps {tokens} --speculative-eagle-topk 1 "
    "--speculative-num-draft-tokens {draft_tokens}"
)
# Our own keys in an SGLang config.json, removed when re-loading the layer config.
SGLANG_EAGLE_KEYS = ("draft_vocab_size", "target_hidden_size", "eagle_config", "ttt_steps")


def check_sglang(head: Eagle3Head) -> None:
    """Raise `ExportError` when SGLang's LlamaForCausalLMEagle3 cannot run this head."""
    if head.norm_before_residual:
        raise ExportError(
            "SGLang's EAGLE-3 layer adds the un-normalised hidden state as the residual "
            "(norm after residual); this head was trained with norm_before_residual=True and "
            "would give different outputs there. Export it with --format vllm instead."
        )
    if len(head.aux_layers) != 3:
        raise ExportError(
            f"SGLang's EAGLE-3 fc takes exactly 3 feature layers; this head has "
            f"{len(head.aux_layers)} ({head.aux_layers})"
        )
    if min(head.aux_layers) < 1:
        raise ExportError(
            f"SGLang names a feature layer by the layer whose output it is; feature layer 0 "
            f"(the embeddings) has no such name (head aux layers {head.aux_layers})"
        )
    c = head.config
    if c.hidden_act != "silu" or c.attention_bias or c.mlp_bias:
        raise ExportError(
            "SGLang's EAGLE-3 layer is a SiLU MLP without biases; this head has "
            f"hidden_act={c.hidden_act}, attention_bias={c.attention_bias}, mlp_bias={c.mlp_bias}"
        )


def sglang_config(head: Eagle3Head) -> dict:
    c = head.config
    rope = dict(c.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    dtype = str(head.fc.weight.dtype).removeprefix("torch.")
    depth = {} if head.ttt_steps is None else {"ttt_steps": head.ttt_steps}
    return {
        "architectures": [SGLANG_ARCH],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_parameters": rope,  # transformers >= 5
        "rope_theta": rope.get("rope_theta", 10000.0),  # transformers 4 / older SGLang
        "rope_scaling": scaling if scaling.get("rope_type", "default") != "default" else None,
        "vocab_size": c.vocab_size,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
        "draft_vocab_size": head.draft_vocab_size,
        "target_hidden_size": head.target_hidden_size,
        "eagle_config": {
            # SGLang captures the stream entering layer id + 1: ours minus one.
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in head.aux_layers],
            "use_aux_hidden_state": True,
        },
        **depth,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def sglang_state_dict(head: Eagle3Head) -> dict[str, torch.Tensor]:
    state = {}
    for name, tensor in head.state_dict().items():
        if name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        elif name.startswith("layers."):
            raise ExportError(f"SGLang's EAGLE-3 head has one decoder layer; found {name}")
        state[name] = tensor.detach().contiguous().cpu()
    return state


def write_head(head: Eagle3Head, options: Options) -> Plan:
    check_vocab_map(head.d2t, head.t2d, head.config.vocab_size, head.draft_vocab_size)
    check_sglang(head)
    name = check_given(head, options.verifier)
    tokens = speculative_tokens(head, options)

    def write(out: Path) -> None:
        (out / "config.json").write_text(json.dumps(sglang_config(head), indent=2) + "\n")
        save_file(sglang_state_dict(head), str(out / WEIGHTS), metadata={"format": "pt"})
        check_head_files(out, config_of(out)["vocab_size"], "midlayer.")

    return Plan(write, name, tokens)


def read_head(directory: Path) -> Eagle3Head:
    """An SGLang export read back as a head (it is itself a valid draft directory)."""
    config = config_of(directory)
    sgl_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not sgl_ids:
        raise ExportError(
            f"{directory}: eagle_config.eagle_aux_hidden_state_layer_ids is missing; the "
            "feature layers of an SGLang EAGLE-3 export must be explicit"
        )
    layer = {
        k: v
        for k, v in config.items()
        if k not in (*SGLANG_EAGLE_KEYS, "architectures", "model_type", "rope_theta")
        and k not in ("rope_scaling", "torch_dtype", "dtype", "transformers_version")
    }
    head = Eagle3Head(
        LlamaConfig(**layer),
        draft_vocab_size=config["draft_vocab_size"],
        target_hidden_size=config.get("target_hidden_size") or config["hidden_size"],
        aux_layers=[i + 1 for i in sgl_ids],  # SGLang: output of layer i; ours: entering i+1
        norm_before_residual=False,  # the only variant SGLang's layer implements
        ttt_steps=config.get("ttt_steps"),
    )
    raw = read_safetensors(directory / WEIGHTS)
    state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in raw.items()}
    head.load_checked(state, f"{directory} (SGLang layout)")
    dtype = weights_dtype(directory)
    return head.to(dtype) if dtype is not None else head
