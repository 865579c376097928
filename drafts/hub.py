"""Loading the target / draft pair through the ordinary Hugging Face path.

`embedded:<name>` resolves to a locally built model directory (drafts/embedded.py); any
other string is a local directory or a Hugging Face model id, loaded the same way.

A name that looks like a path must be a model directory: a missing one, or one without
config.json (an interrupted save), raises `ModelNotFoundError` naming it. A hub id is
looked up in the local Hugging Face cache only when HF_HUB_OFFLINE is set or the hub cannot
be reached (one 2-second connection attempt per process), so an offline machine fails in
seconds instead of retrying for a minute.
"""

import functools
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch
from specdistill.drafts.embedded import PREFIX, resolve_model
from transformers import AutoModelForCausalLM, AutoTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TokenizerMismatchError(ValueError):
    """Target and draft do not share a tokenizer, so draft tokens cannot be verified."""


class ModelNotFoundError(OSError):
    """A model name names no usable local directory, or a hub model that cannot be fetched."""


def load_tokenizer(name: str, revision: str | None = None):
    return _from_pretrained(AutoTokenizer, name, revision)


def load_model(name: str, *, dtype: str = "float32", revision: str | None = None):
    return _from_pretrained(AutoModelForCausalLM, name, revision, dtype=DTYPES[dtype])


def load_draft(name: str, *, dtype: str = "float32", revision: str | None = None):
    """A standalone draft (like `load_model`) or an EAGLE-3 head dir (drafts/eagle3_head.py)."""
    path = local_model_dir(name)  # checks a local path before the imports
    # The head's own check (what `drafts.Eagle3.detect` uses): the drafts package imports
    # this module, so this module does not import the package.
    from specdistill.drafts.eagle3_head import Eagle3Head, is_eagle3_dir

    if path is not None and is_eagle3_dir(path):
        return Eagle3Head.from_pretrained(path, dtype=DTYPES[dtype])
    return load_model(name, dtype=dtype, revision=revision)


def _from_pretrained(auto_class, name: str, revision: str | None, **kwargs):
    path = local_model_dir(name)
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
