"""Published draft versions: ROOT/vNNNNNN/ (the draft as its type saves it, plus
manifest.json) and ROOT/current, the layout the server follows (formats/published.py).

A version is written under ROOT/.tmp-vNNNNNN, flushed and renamed into place
(specdistill.publish.publish_dir); only then is `current` replaced (atomic_write_text). A
kill at any point leaves `current` naming a complete version; leftovers (.tmp-*, .old-*)
are removed before the next publish (`specdistill.publish.remove_leftovers`). Pruning keeps
the newest `keep` versions and never removes the one `current` names or its parent.
"""

import dataclasses
import json
import shutil
import time
from pathlib import Path

from specdistill.drafts.loader import load_draft
from specdistill.errors import UserError
from specdistill.formats.published import (
    VERSION,
    Manifest,
    read_current,
    read_manifest,
    version_draft_dir,
    version_name,
    version_number,
)
from specdistill.publish import atomic_write_text, publish_dir, remove_leftovers
from specdistill.train.run_dir import Faults, no_faults


def versions(root) -> list[str]:
    """Complete versions of ROOT (a directory with manifest.json), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        p.name for p in root.iterdir() if VERSION.match(p.name) and (p / "manifest.json").is_file()
    ]
    return sorted(found)


def check_loads(root, version: str) -> None:
    """Load ROOT/`version` as the server would (drafts.loader.load_draft: all of its config's
    tensors from its weights); a ValueError naming the version and the problem if it fails."""
    path = Path(root) / version
    try:
        load_draft(str(version_draft_dir(root, version)))
    except Exception as e:  # noqa: BLE001 - any failure to load means a broken version
        why = " ".join(str(e).split())[:600] or type(e).__name__
        raise UserError(f"{path}: version {version} does not load ({why})") from None


def next_version(root) -> str:
    root = Path(root)
    numbers = [version_number(p.name) for p in root.iterdir()] if root.is_dir() else []
    return version_name(max((n for n in numbers if n is not None), default=0) + 1)


def publish_version(
    root,
    save,
    manifest: Manifest,
    *,
    keep: int = 5,
    version: str | None = None,
    faults: Faults = no_faults,
) -> str:
    """Write a new version with `save(directory)` and its manifest (version, parent and time
    filled in here), then point `current` at it. Returns the version name (`version`: that
    name, chosen beforehand by the caller, e.g. the online job's publish-pending marker;
    default the next free one). `faults`: the crash-test hook (tests only)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    remove_leftovers(root)
    version = version or next_version(root)
    if (root / version).exists():
        raise FileExistsError(f"{root / version}: version already exists")
    tmp = root / f".tmp-{version}"
    tmp.mkdir()
    save(tmp)
    faults("publish:saved")
    manifest = dataclasses.replace(
        manifest, version=version, parent=read_current(root), time=time.time()
    )
    manifest.write(tmp)
    faults("publish:manifest")
    publish_dir(tmp, root / version)
    faults("publish:renamed")
    atomic_write_text(root / "current", version + "\n")
    prune(root, keep)
    return version


def prune(root, keep: int) -> list[str]:
    root = Path(root)
    current = read_current(root)
    protected = {current}
    if current and (root / current).is_dir():
        protected.add(read_manifest(root / current).parent)
    removed = []
    for v in versions(root)[:-keep] if keep > 0 else []:
        if v not in protected:
            shutil.rmtree(root / v, ignore_errors=True)
            removed.append(v)
    return removed


def rollback(root, version: str | None = None) -> tuple[str, str]:
    """Point ROOT/current at `version` (default: the parent of the current one), once it is
    found to load (`check_loads`; else a ValueError and `current` is left as it is).
    Returns (from, to). Appends the event to ROOT/rollbacks.jsonl."""
    root = Path(root)
    current = read_current(root)
    if current is None:
        raise FileNotFoundError(f"{root / 'current'}: no current version to roll back from")
    if version is None:
        version = read_manifest(root / current).parent
        if not version:
            raise UserError(f"{root / current}: version {current} has no parent to roll back to")
    if not VERSION.match(version):
        raise UserError(f"{version!r} is not a version like v000001")
    if not (root / version / "manifest.json").is_file():
        raise FileNotFoundError(f"{root / version}: no such complete version")
    try:
        check_loads(root, version)
    except ValueError as e:
        raise UserError(f"{e}; current stays {current}") from None
    atomic_write_text(root / "current", version + "\n")
    with open(root / "rollbacks.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), "from": current, "to": version}) + "\n")
    return current, version
