"""The verifier (the target a draft was trained on), as every export format resolves it.

The name written into a speculators config comes from --verifier, else the training recipe's
target.model (recipe.yaml in the draft directory, or beside it when it is a run's `final/`),
else the verifier already in the draft's own config. `embedded:<name>` targets are written as
their built local directory. When the verifier's config can be read (a local directory, or
the Hugging Face cache) its architectures are filled in and its hidden size, vocabulary and
depth are checked against the head.
"""

import json
import sys
from pathlib import Path

from specdistill.train.export.common import ExportError, config_of, recipe_value


def recipe_target(directory: Path | None) -> str | None:
    """target.model of the training recipe of the draft in `directory`."""
    model = recipe_value(directory, "target", "model")
    return str(model) if model else None


def resolve_name(name: str) -> str:
    """`embedded:<name>` -> its built directory when built (never builds); `registry:<name>`
    -> the hub model it was quantized from, which engines load; else unchanged."""
    from specdistill.models import registry
    from specdistill.models.embedded import PREFIX, _model_dir

    if name.startswith(registry.PREFIX):
        try:
            entry = registry.spec_of(name)
        except registry.RegistryError as e:
            raise ExportError(str(e)) from e
        print(
            f"verifier: {entry.hub_id}, the original of {name} (the draft was trained against "
            f"a {entry.quantization} quantization of it from {entry.package}=={entry.version}, "
            "dequantized to float32; serve it beside the original weights)",
            file=sys.stderr,
        )
        return entry.hub_id
    if not name.startswith(PREFIX):
        return name
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


def verifier_config(name: str) -> dict | None:
    """The verifier's config.json as a dict, from a local directory or the HF cache only."""
    config = config_of(Path(name)) if Path(name).is_dir() else None
    if config is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name, "config.json")
        except Exception:  # noqa: BLE001 - not a repo id, no cache: nothing to read
            cached = None
        if isinstance(cached, str) and Path(cached).is_file():
            config = json.loads(Path(cached).read_text())
    return config


def resolve(source: Path | None, verifier: str | None) -> tuple[str | None, list[str], dict | None]:
    """(name_or_path, architectures, its config dict or None) of the target of the draft in
    `source` (None: an in-memory draft, which only the flag can name)."""
    existing = {}
    if source is not None:
        if verifier is None:
            verifier = recipe_target(source)
        config = config_of(source) or {}
        existing = (config.get("speculators_config") or {}).get("verifier") or {}
        if verifier is None:
            verifier = existing.get("name_or_path")
    if verifier is None:
        return None, [], None
    name = resolve_name(str(verifier))
    config = verifier_config(name)
    if config is not None:
        archs = list(config.get("architectures") or [])
    elif existing.get("name_or_path") == name:
        archs = list(existing.get("architectures") or [])
    else:
        archs = []
    return name, archs, config


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


def check_given(head, verifier: str | None) -> str | None:
    """Check a --verifier against the head, for a layout with no verifier field (SGLang)."""
    if verifier is None:
        return None
    name = resolve_name(verifier)
    check_head(head, name, verifier_config(name))
    return name


def warn_vocab(model, verifier: str | None) -> str | None:
    """A standalone draft: warn when a given verifier's vocabulary differs from the draft's."""
    if verifier is None:
        return None
    name = resolve_name(verifier)
    theirs = (verifier_config(name) or {}).get("vocab_size")
    ours = getattr(model.config, "vocab_size", None)
    if theirs is not None and ours is not None and theirs != ours:
        print(
            f"warning: draft vocab_size {ours} differs from verifier {verifier}'s "
            f"{theirs}; engines need draft and target to share the tokenizer",
            file=sys.stderr,
        )
    return name
