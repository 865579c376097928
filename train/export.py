"""Export a trained draft for an inference engine: vLLM, SGLang or a Hugging Face directory.

    python train/export.py --draft runs/code/final --format vllm --out exports/code-vllm
    python train/export.py --draft runs/eagle/final --format sglang --out exports/eagle-sgl \
        --verifier Qwen/Qwen2.5-Coder-7B-Instruct [--overwrite]

The draft type is read from --draft (REFERENCE §4, §5):

EAGLE-3 head (a directory written by `Eagle3Head.save_pretrained`: config.json with
`speculators_model_type: eagle3` + model.safetensors; an SGLang EAGLE-3 export is read too):

  vllm    the `speculators` layout (REFERENCE §5): config.json with every field written
          explicitly (`transformer_layer_config`, `draft_vocab_size`, `target_hidden_size`,
          `eagle_aux_hidden_state_layer_ids`, `norm_before_residual`, the norm flags, and
          `speculators_config` with the verifier's name_or_path and architectures) and
          model.safetensors (fc, layers.0.*, norm, lm_head, embed_tokens, d2t int64, t2d bool).
          Serve it with
              vllm serve {target} --speculative-config \
                  '{"model": "OUT", "num_speculative_tokens": 3, "method": "eagle3"}'
          or `vllm serve OUT` alone, which starts the verifier named in the config.
  sglang  config.json with architectures ["LlamaForCausalLMEagle3"], model_type "llama", the
          decoder layer's Llama fields (num_hidden_layers 1, tie_word_embeddings false),
          `draft_vocab_size`, `target_hidden_size` and `eagle_config.eagle_aux_hidden_state_
          layer_ids`; weights fc.weight, midlayer.*, norm.weight, lm_head.weight,
          embed_tokens.weight, d2t, t2d (`layers.0.` renamed `midlayer.`). Serve it with
              python -m sglang.launch_server --model-path TARGET \
                  --speculative-algorithm EAGLE3 --speculative-draft-model-path OUT \
                  --speculative-num-steps 3 --speculative-eagle-topk 1 \
                  --speculative-num-draft-tokens 4
          SGLang's layer always adds the residual before the norm, takes exactly three feature
          layers, and counts a feature layer as the *output* of layer i (it captures the
          stream entering layer i + 1), while this project and vLLM name the layer the stream
          enters: the ids written are ours minus one. A head trained with
          norm_before_residual=True, or with another number of feature layers, is refused.
  hf      the `speculators` layout again, byte for byte what `vllm` writes: it is what EAGLE-3
          repositories on the Hugging Face Hub hold (and what `speculators` and vLLM load).

Standalone draft (a plain Hugging Face causal-LM directory): every format writes a plain causal
LM directory (config.json, model.safetensors, generation config, the tokenizer files of
--draft); engines load it as a draft model path:
    vllm serve {target} --speculative-config '{"model": "OUT", "num_speculative_tokens": 5}'
    python -m sglang.launch_server --model-path {target} --speculative-algorithm STANDALONE \
        --speculative-draft-model-path OUT --speculative-num-steps 4 \
        --speculative-eagle-topk 1 --speculative-num-draft-tokens 5

The verifier (the target the head was trained on) written into a speculators config comes
from --verifier, else the training recipe (recipe.yaml in --draft, or beside it when --draft
is a run's `final/`), else the verifier already in --draft's config. `embedded:<name>`
targets are written as their built local directory. When the verifier's config can be
read (a local directory, or the Hugging Face cache) its architectures are filled in and its
hidden size, vocabulary and depth are checked against the head.

Before anything is written the d2t / t2d map is checked (`check_vocab_map`): a missing or
inconsistent map is a `VocabMapError`, never a silently misaligned vocabulary. A non-empty
--out is refused unless --overwrite; the export is written to a temporary directory beside
--out, re-read and checked, then renamed into place. `load_export(out, fmt)` re-loads any
export as a module giving logits (an `Eagle3Head`, or the causal LM).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from specdistill.drafts.eagle3_head import Eagle3Head, VocabMapError, check_vocab_map, is_eagle3_dir

FORMATS = ("vllm", "sglang", "hf")
SGLANG_ARCH = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
# Our own keys in an SGLang config.json, removed when re-loading the layer config.
SGLANG_EAGLE_KEYS = ("draft_vocab_size", "target_hidden_size", "eagle_config")

__all__ = ["ExportError", "FORMATS", "export", "load_export", "main", "VocabMapError"]


class ExportError(ValueError):
    """The draft cannot be exported in the requested format (or --out is not usable)."""


# ----------------------------------------------------------------------------- reading drafts


def _weights_dtype(directory: Path) -> torch.dtype | None:
    """The floating dtype the weights were saved in (kept through the export)."""
    from safetensors import safe_open

    path = directory / WEIGHTS
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            tensor = f.get_slice(key)
            dtype = _SAFETENSORS_DTYPES.get(tensor.get_dtype())
            if dtype is not None:
                return dtype
    return None


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _read_config(directory: Path) -> dict | None:
    path = directory / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{path} is not valid JSON: {e}") from e


def is_sglang_eagle3_dir(path) -> bool:
    config = _read_config(Path(path))
    return bool(config) and SGLANG_ARCH in (config.get("architectures") or [])


def draft_kind(path) -> str:
    """'eagle3' (speculators layout), 'sglang-eagle3' or 'standalone' (plain HF causal LM)."""
    if is_eagle3_dir(path):
        return "eagle3"
    if is_sglang_eagle3_dir(path):
        return "sglang-eagle3"
    return "standalone"


def _load_standalone(directory: Path):
    from transformers import AutoModelForCausalLM

    if not (directory / "config.json").is_file():
        raise ExportError(
            f"{directory}: no config.json; --draft must be an EAGLE-3 head directory "
            "(speculators or SGLang layout) or a Hugging Face causal LM directory"
        )
    try:
        return AutoModelForCausalLM.from_pretrained(str(directory), dtype="auto")
    except (OSError, ValueError, KeyError) as e:
        raise ExportError(
            f"{directory} is neither an EAGLE-3 head directory nor a Hugging Face causal LM "
            f"directory that AutoModelForCausalLM can load: {e}"
        ) from e


def _load_sglang_head(directory: Path, dtype: torch.dtype | None = None) -> Eagle3Head:
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    config = _read_config(directory)
    eagle = config.get("eagle_config") or {}
    sgl_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
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
    )
    raw = load_file(str(directory / WEIGHTS))
    state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in raw.items()}
    head.load_checked(state, f"{directory} (SGLang layout)")
    return head.to(dtype) if dtype is not None else head


def load_draft(draft) -> tuple[str, nn.Module]:
    """(kind, module) for a draft directory, or an in-memory `Eagle3Head` / causal LM."""
    if isinstance(draft, Eagle3Head):
        return "eagle3", draft
    if isinstance(draft, nn.Module):
        return "standalone", draft
    directory = Path(draft)
    if not directory.is_dir():
        raise ExportError(f"draft directory {directory} does not exist")
    kind = draft_kind(directory)
    if kind == "eagle3":
        return kind, Eagle3Head.from_pretrained(directory, dtype=_weights_dtype(directory))
    if kind == "sglang-eagle3":
        return "eagle3", _load_sglang_head(directory, _weights_dtype(directory))
    return kind, _load_standalone(directory)


# ----------------------------------------------------------------------------- the verifier


def _recipe_target(directory: Path) -> str | None:
    """target.model of the training recipe in `directory` (or its run dir, for `final/`)."""
    import yaml

    candidates = [directory / "recipe.yaml"]
    if directory.name == "final":  # the trainer writes <output_dir>/{recipe.yaml, final/}
        candidates.append(directory.parent / "recipe.yaml")
    for candidate in candidates:
        if candidate.is_file():
            raw = yaml.safe_load(candidate.read_text()) or {}
            target = raw.get("target") if isinstance(raw, dict) else None
            model = target.get("model") if isinstance(target, dict) else None
            if model:
                return str(model)
    return None


def _resolve_embedded(name: str) -> str:
    """`embedded:<name>` -> its built directory when built (never builds); else unchanged."""
    from specdistill.train.embedded import PREFIX

    if not name.startswith(PREFIX):
        return name
    from specdistill.train.embedded import _model_dir

    try:
        path = _model_dir(name.removeprefix(PREFIX))
    except ValueError as e:
        raise ExportError(str(e)) from e
    if (path / "config.json").is_file():
        return str(path)
    print(
        f"warning: verifier {name} is not built on this machine; written as is, which engines "
        "cannot load (build it, or pass --verifier)",
        file=sys.stderr,
    )
    return name


def _verifier_config(name: str) -> dict | None:
    """The verifier's config.json as a dict, from a local directory or the HF cache only."""
    config = _read_config(Path(name)) if Path(name).is_dir() else None
    if config is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name, "config.json")
        except Exception:  # noqa: BLE001 - not a repo id, no cache: nothing to read
            cached = None
        if isinstance(cached, str) and Path(cached).is_file():
            config = json.loads(Path(cached).read_text())
    return config


def resolve_verifier(draft, verifier: str | None) -> tuple[str | None, list[str], dict | None]:
    """(name_or_path, architectures, its config dict or None) of the target for a head."""
    existing = {}
    if not isinstance(draft, nn.Module):
        directory = Path(draft)
        if verifier is None:
            verifier = _recipe_target(directory)
        config = _read_config(directory) or {}
        existing = (config.get("speculators_config") or {}).get("verifier") or {}
        if verifier is None:
            verifier = existing.get("name_or_path")
    if verifier is None:
        return None, [], None
    name = _resolve_embedded(str(verifier))
    config = _verifier_config(name)
    if config is not None:
        archs = list(config.get("architectures") or [])
    elif existing.get("name_or_path") == name:
        archs = list(existing.get("architectures") or [])
    else:
        archs = []
    return name, archs, config


def _check_verifier(head: Eagle3Head, name: str, config: dict | None) -> None:
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


# ----------------------------------------------------------------------------- formats


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


def _save_sglang(head: Eagle3Head, out: Path) -> None:
    from safetensors.torch import save_file

    check_sglang(head)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(sglang_config(head), indent=2) + "\n")
    save_file(sglang_state_dict(head), str(out / WEIGHTS), metadata={"format": "pt"})


def _copy_tokenizer(source, out: Path) -> list[str]:
    if isinstance(source, nn.Module) or source is None:
        return []
    copied = []
    for name in TOKENIZER_FILES:
        path = Path(source) / name
        if path.is_file():
            shutil.copy2(path, out / name)
            copied.append(name)
    return copied


# ----------------------------------------------------------------------------- checks after


def _verify_written(directory: Path, fmt: str, kind: str) -> None:
    """Re-read what was written: the vocab map and the exact weight names."""
    from safetensors import safe_open

    if kind == "standalone":
        if not any(directory.glob("*.safetensors")):
            raise ExportError(f"export wrote no safetensors weights in {directory}")
        return
    config = json.loads((directory / "config.json").read_text())
    with safe_open(str(directory / WEIGHTS), framework="pt") as f:
        names = set(f.keys())
        d2t = f.get_tensor("d2t") if "d2t" in names else None
        t2d = f.get_tensor("t2d") if "t2d" in names else None
    vocab = (
        config["vocab_size"]
        if fmt == "sglang"
        else config["transformer_layer_config"]["vocab_size"]
    )
    check_vocab_map(d2t, t2d, vocab, config["draft_vocab_size"])
    layer = "midlayer." if fmt == "sglang" else "layers.0."
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
            f"export weight names differ from the {fmt} layout: missing "
            f"{sorted(expected - names)}, unexpected {sorted(names - expected)}"
        )


# ----------------------------------------------------------------------------- export


def _prepare_out(out: Path, overwrite: bool, draft) -> None:
    if not isinstance(draft, nn.Module):
        src = Path(draft).resolve()
        dst = out.resolve()
        if dst == src or src in dst.parents or dst in src.parents:
            raise ExportError(f"--out {out} must not be, contain or lie inside --draft {draft}")
    if out.exists():
        if not out.is_dir():
            raise ExportError(f"--out {out} exists and is not a directory")
        if any(out.iterdir()) and not overwrite:
            raise ExportError(f"--out {out} is not empty; pass --overwrite to replace it")


def _publish(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`, replacing an existing `out` only once the new one is complete."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export(draft, fmt: str, out, verifier: str | None = None, *, overwrite: bool = False) -> Path:
    """Export `draft` (a directory, or an in-memory `Eagle3Head` / causal LM) as `fmt` in `out`.

    Returns the path written. Raises `VocabMapError` for a bad d2t / t2d map and
    `ExportError` for a draft the format cannot hold or an unusable `out`; in both cases
    nothing is written.
    """
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    out = Path(out)
    _prepare_out(out, overwrite, draft)
    kind, model = load_draft(draft)

    if kind == "eagle3":
        head = model
        check_vocab_map(head.d2t, head.t2d, head.config.vocab_size, head.draft_vocab_size)
        if fmt == "sglang":  # SGLang's config has no verifier field: only check one given
            check_sglang(head)
            name, archs = None, []
            if verifier is not None:
                resolved = _resolve_embedded(verifier)
                _check_verifier(head, resolved, _verifier_config(resolved))
        else:
            name, archs, vconfig = resolve_verifier(draft, verifier)
            _check_verifier(head, name, vconfig)
    else:
        name, archs = None, []
        if verifier is not None:
            vconfig = _verifier_config(_resolve_embedded(verifier))
            theirs = (vconfig or {}).get("vocab_size")
            ours = getattr(model.config, "vocab_size", None)
            if theirs is not None and ours is not None and theirs != ours:
                print(
                    f"warning: draft vocab_size {ours} differs from verifier {verifier}'s "
                    f"{theirs}; engines need draft and target to share the tokenizer",
                    file=sys.stderr,
                )

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if kind == "eagle3" and fmt == "sglang":
            _save_sglang(model, tmp)
        elif kind == "eagle3":
            model.save_pretrained(tmp, verifier=name, verifier_arch=archs)
        else:
            model.save_pretrained(str(tmp))
        _copy_tokenizer(draft, tmp)
        _verify_written(tmp, fmt, kind)
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_export(out, fmt: str) -> nn.Module:
    """Re-load an export: an `Eagle3Head` (vllm / hf / sglang heads) or the causal LM."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    directory = Path(out)
    dtype = _weights_dtype(directory)
    if fmt == "sglang" and is_sglang_eagle3_dir(directory):
        return _load_sglang_head(directory, dtype)
    if fmt in ("vllm", "hf") and is_eagle3_dir(directory):
        return Eagle3Head.from_pretrained(directory, dtype=dtype)
    return _load_standalone(directory)


SERVE_HINTS = {
    ("eagle3", "vllm"): "vllm serve {target} --speculative-config "
    '\'{{"model": "{out}", "num_speculative_tokens": 3, "method": "eagle3"}}\'',
    ("eagle3", "sglang"): "python -m sglang.launch_server --model-path {target} "
    "--speculative-algorithm EAGLE3 --speculative-draft-model-path {out}",
    ("standalone", "vllm"): "vllm serve {target} --speculative-config "
    '\'{{"model": "{out}", "num_speculative_tokens": 5}}\'',
    ("standalone", "sglang"): "python -m sglang.launch_server --model-path {target} "
    "--speculative-algorithm STANDALONE --speculative-draft-model-path {out}",
}
# `hf` is the layout vLLM loads.
SERVE_HINTS |= {(kind, "hf"): SERVE_HINTS[kind, "vllm"] for kind in ("eagle3", "standalone")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Export a trained draft (EAGLE-3 head or standalone causal LM) for "
        "vLLM, SGLang or the Hugging Face Hub layout."
    )
    parser.add_argument("--draft", required=True, help="trained draft directory")
    parser.add_argument("--format", required=True, choices=FORMATS, dest="fmt")
    parser.add_argument("--out", required=True, help="output directory (must be empty)")
    parser.add_argument(
        "--verifier",
        default=None,
        help="target model id or path written into a speculators config "
        "(default: the training recipe's target, else the draft config's verifier)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = parser.parse_args(argv)
    try:
        out = export(args.draft, args.fmt, args.out, args.verifier, overwrite=args.overwrite)
    except (ValueError, OSError) as e:  # ExportError, VocabMapError, unreadable drafts
        print(f"error: {e}", file=sys.stderr)
        return 2
    kind = "eagle3" if is_eagle3_dir(out) or is_sglang_eagle3_dir(out) else "standalone"
    print(f"wrote {args.fmt} export of the {kind} draft to {out}")
    # The verifier the export names (speculators layouts), else the one given, else a slot.
    written = ((_read_config(out) or {}).get("speculators_config") or {}).get("verifier") or {}
    given = _resolve_embedded(args.verifier) if args.verifier else None
    target = written.get("name_or_path") or given or "TARGET"
    print("serve with: " + SERVE_HINTS[(kind, args.fmt)].format(out=out, target=target))
    return 0


if __name__ == "__main__":
    from specdistill.errors import run_guarded

    sys.exit(run_guarded(main, sys.argv[1:]))
