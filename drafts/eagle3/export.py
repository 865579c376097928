"""The EAGLE-3 head's export in the `speculators` layout (formats vllm and hf), and what its
SGLang writer (sglang.py) shares: the number of speculative tokens, the verifier's check
against the head and the re-read of a written head.

vllm (docs/theory.md §5): config.json with every field written explicitly
(`transformer_layer_config`, `draft_vocab_size`, `target_hidden_size`,
`eagle_aux_hidden_state_layer_ids`, `norm_before_residual`, the norm flags, and
`speculators_config` with the number of speculative tokens and the verifier's name_or_path
and architectures) and model.safetensors (fc, layers.0.*, norm, lm_head, embed_tokens,
d2t int64, t2d bool): what `Eagle3Head.save_pretrained` writes. `vllm serve OUT` alone starts
the verifier named in the config and proposes that many tokens.

hf: byte for byte what vllm writes. It is what EAGLE-3 repositories on the Hugging Face Hub
hold (and what `speculators` and vLLM load).
"""

import sys
from pathlib import Path

from safetensors import safe_open

from specdistill.drafts import verifier
from specdistill.drafts.eagle3.head import DEFAULT_SPECULATIVE_TOKENS, Eagle3Head, check_vocab_map
from specdistill.drafts.export import (
    WEIGHTS,
    ExportError,
    Options,
    Plan,
    config_of,
    recipe_value,
    weights_dtype,
)

HINT = (
    "vllm serve {target} --speculative-config "
    '\'{{"model": "{out}", "num_speculative_tokens": {tokens}, "method": "eagle3"}}\''
)


def speculative_tokens(head, options: Options) -> int:
    """--speculative-tokens, else the head's recorded training depth (`ttt_steps`), else the
    training recipe's draft.ttt_steps, else `DEFAULT_SPECULATIVE_TOKENS` with a note."""
    if options.speculative_tokens is not None:
        return options.speculative_tokens
    if getattr(head, "ttt_steps", None):
        return int(head.ttt_steps)
    steps = recipe_value(options.source, "draft", "ttt_steps")
    if steps is not None:
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ExportError(f"the training recipe's draft.ttt_steps is {steps!r}, not >= 1")
        return steps
    print(
        "note: the head records no training depth and no training recipe gives "
        f"draft.ttt_steps; writing {DEFAULT_SPECULATIVE_TOKENS} speculative tokens "
        "(pass --speculative-tokens N to choose)",
        file=sys.stderr,
    )
    return DEFAULT_SPECULATIVE_TOKENS


# ----------------------------------------------------------------------------- the verifier


def check_head(head, name: str | None, config: dict | None) -> None:
    """Raise `ExportError` when the verifier's config contradicts the head's geometry."""
    if config is None:
        return
    text = config.get("text_config") or config
    checks = (
        ("hidden_size", text.get("hidden_size"), head.target_hidden_size),
        ("vocab_size", text.get("vocab_size"), head.config.vocab_size),
    )
    for field, theirs, ours in checks:
        if theirs is not None and theirs != ours:
            raise ExportError(
                f"verifier {name} has {field} {theirs} but the head was built for {ours}: "
                "wrong --verifier?"
            )
    layers = text.get("num_hidden_layers")
    if layers is not None and max(head.aux_layers) >= layers:
        raise ExportError(
            f"verifier {name} has {layers} layers but the head reads feature layer "
            f"{max(head.aux_layers)}: wrong --verifier?"
        )


def check_given(head, name: str | None) -> str | None:
    """Check a --verifier against the head, for a layout with no verifier field (SGLang)."""
    if name is None:
        return None
    resolved = verifier.resolve_name(name)
    check_head(head, resolved, verifier.verifier_config(resolved))
    return resolved


# ----------------------------------------------------------------------------- after writing


def check_head_files(directory: Path, vocab_size: int, layer: str) -> None:
    """Re-read an EAGLE-3 export: the vocab map and the exact weight names (`layer`: the
    decoder layer's prefix, `layers.0.` or `midlayer.`)."""
    config = config_of(directory) or {}
    with safe_open(str(directory / WEIGHTS), framework="pt") as f:
        names = set(f.keys())
        d2t = f.get_tensor("d2t") if "d2t" in names else None
        t2d = f.get_tensor("t2d") if "t2d" in names else None
    check_vocab_map(d2t, t2d, vocab_size, config["draft_vocab_size"])
    expected = {"d2t", "t2d", "embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight"}
    expected |= {
        layer + n
        for n in (
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "input_layernorm.weight",
            "hidden_norm.weight",
            "post_attention_layernorm.weight",
        )
    }
    if names != expected:
        raise ExportError(
            f"export weight names differ from the {layer.rstrip('.')} layout: missing "
            f"{sorted(expected - names)}, unexpected {sorted(names - expected)}"
        )


# ----------------------------------------------------------------------------- the layout


def write_head(head: Eagle3Head, options: Options) -> Plan:
    check_vocab_map(head.d2t, head.t2d, head.config.vocab_size, head.draft_vocab_size)
    name, archs, config = verifier.resolve(options.source, options.verifier)
    check_head(head, name, config)
    tokens = speculative_tokens(head, options)

    def write(out: Path) -> None:
        head.save_pretrained(out, verifier=name, verifier_arch=archs, speculative_tokens=tokens)
        vocab = config_of(out)["transformer_layer_config"]["vocab_size"]
        check_head_files(out, vocab, "layers.0.")

    return Plan(write, name, tokens)


def read_head(directory: Path) -> Eagle3Head:
    return Eagle3Head.from_pretrained(directory, dtype=weights_dtype(directory))
