"""A model's identity: a hash of its config and weight files (and of a peft adapter put on
top of it), so that a server, a traffic log, a target cache and an online job agree on which
target produced a distribution exactly when they run the same files."""

import hashlib
import re
from pathlib import Path

from specdistill.models.hub import local_model_dir


def model_identity(name: str, model=None, adapter: str | None = None) -> str:
    """sha256 over a model directory's config and weight files: `sha256:<hex>`; for a hub id
    without a local directory, over the name and the config. With `adapter` (a peft adapter
    directory put on top of `name`, unmerged, as `models.hub.load_target` does), the identity
    is `<base identity>+adapter:sha256:<hex>`, the second hash over the adapter directory's
    adapter_config.json and weight files: a server and an online job agree on it exactly when
    they use the same base and the same adapter files, and a bare base never matches it."""
    h = hashlib.sha256()
    path = None
    try:
        path = local_model_dir(name)
    except OSError:
        path = None
    if path is not None:
        _hash_files(h, Path(path))
    else:
        h.update(name.encode() + b"\0")
        if model is not None:
            h.update(model.config.to_json_string().encode())
    identity = "sha256:" + h.hexdigest()
    if adapter:
        adapter_dir = Path(adapter).expanduser()
        if not (adapter_dir / "adapter_config.json").is_file():
            raise FileNotFoundError(
                f"{adapter}: not a peft adapter directory (adapter_config.json missing)"
            )
        ha = hashlib.sha256()
        _hash_files(ha, adapter_dir)
        identity += "+adapter:sha256:" + ha.hexdigest()
    return identity


def _hash_files(h, directory: Path) -> None:
    wanted = re.compile(r"(config\.json|adapter_config\.json|.*\.safetensors|.*\.bin)$")
    for f in sorted(directory.iterdir()):
        if f.is_file() and wanted.match(f.name):
            h.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
