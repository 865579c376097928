"""The verifier (the target a draft was trained on), as the export writers resolve it.

The name written into a speculators config comes from --verifier, else the training recipe's
target.model (recipe.yaml in the draft directory, or beside it when it is a run's `final/`),
else the verifier already in the draft's own config. `embedded:<name>` targets are written as
their built local directory. When the verifier's config can be read (a local directory, or
the Hugging Face cache) its architectures are filled in and its hidden size, vocabulary and
depth are checked against the head (drafts/eagle3/export.py; a standalone draft's
vocabulary: drafts/standalone/export.py).
"""

import json
import sys
from pathlib import Path

from huggingface_hub import try_to_load_from_cache

from specdistill.drafts.export import ExportError, config_of, recipe_value
from specdistill.models import registry
from specdistill.models.embedded import PREFIX, model_dir


def recipe_target(directory: Path | None) -> str | None:
    """target.model of the training recipe of the draft in `directory`."""
    model = recipe_value(directory, "target", "model")
    return str(model) if model else None


def resolve_name(name: str) -> str:
    """`embedded:<name>` -> its built directory when built (never builds); `registry:<name>`
    -> the hub model it was quantized from, which engines load; else unchanged."""
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
        path = model_dir(name.removeprefix(PREFIX))
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
