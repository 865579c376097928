"""A published drafts root: the versions the online job publishes and the server follows.

    ROOT/v000001/            a draft directory (standalone HF dir or EAGLE-3 head) + manifest.json
    ROOT/v000002/
    ROOT/current             one line naming the version served, e.g. "v000002"; replaced
                             atomically (specdistill.publish.atomic_write_text)

A version's name is "v" and six digits, numbered from v000001 (`version_name`). Its
manifest (`Manifest`) says what it is and where it came from. Only ROOT's own versions are
read: a version directory, or a manifest's `draft_dir`, that resolves outside ROOT is
refused (`version_draft_dir`). Writing versions and `current` is the online job's
(train/online/versions.py); following `current` is the server's (serve/drafts.py).
"""

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

from specdistill.errors import UserError

VERSION = re.compile(r"^v(\d{6})$")  # `version_name`


def version_name(number: int) -> str:
    """The name of version `number` (1 -> "v000001")."""
    return f"v{number:06d}"


def version_number(name: str) -> int | None:
    """The number of the version called `name`, or None when it is not a version's name."""
    match = VERSION.match(name)
    return int(match[1]) if match else None


@dataclass
class Manifest:
    """ROOT/vNNNNNN/manifest.json: what a published version is and where it came from.

    version, parent (the version `current` named when it was published) and time are set by
    the publisher (train/online/versions.py `publish_version`); the rest by the job. A
    promotion's gate numbers are null for the initial draft. draft_dir: the draft's
    directory inside the version, when it is not the version directory itself."""

    version: str | None = None
    parent: str | None = None
    time: float | None = None
    target: dict | None = None  # {"name", "identity"} (specdistill.models.identity)
    draft_type: str | None = None
    reason: str | None = None  # "initial draft" or "promoted"
    records_trained: int = 0
    policy: str | None = None
    traffic_window: list[float] | None = None  # [first, last] record time of the refresh
    alpha: float | None = None
    alpha_incumbent: float | None = None
    delta: float | None = None
    ci: list[float] | None = None
    confidence: float | None = None
    loss: float | None = None
    cursor: dict | None = None
    draft_dir: str | None = None

    @classmethod
    def from_dict(cls, fields: dict) -> "Manifest":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in fields.items() if k in known})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def draft_path(self, version_dir: Path) -> Path:
        return version_dir / self.draft_dir if self.draft_dir else version_dir

    def write(self, version_dir: Path) -> None:
        (version_dir / "manifest.json").write_text(json.dumps(self.to_dict(), indent=1))


class CurrentUnreadableError(UserError):
    """ROOT/current exists but cannot be read as a version name (not UTF-8, not a file)."""


class OutsideRootError(UserError):
    """A version (or its manifest's draft_dir) that resolves outside the drafts root."""


def read_manifest(version_dir: Path) -> Manifest:
    """The version's manifest (an empty one when it has no manifest.json)."""
    try:
        return Manifest.from_dict(json.loads((version_dir / "manifest.json").read_text()))
    except FileNotFoundError:
        return Manifest()


def read_current(root: Path) -> str | None:
    """The version ROOT/current names (None when there is no such file or it is empty);
    `CurrentUnreadableError` when it exists but is not a UTF-8 text file."""
    path = Path(root) / "current"
    try:
        name = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise CurrentUnreadableError(
            f"{path}: cannot read the current version ({why}); write the version's name "
            "(e.g. v000001) to it, or roll back with specdistill online rollback"
        ) from None
    return name or None


def version_draft_dir(root: Path, version: str) -> Path:
    """The draft directory of ROOT/`version` (its manifest's draft_dir, or the version
    directory), resolved; `OutsideRootError` when it lies outside ROOT."""
    root = Path(root)
    if not VERSION.match(version):
        raise UserError(f"{version!r} is not a version like v000001")
    inside = root.resolve()
    path = (root / version).resolve()
    manifest = read_manifest(path)
    draft_dir = manifest.draft_dir
    if draft_dir is not None and not isinstance(draft_dir, str):
        raise UserError(f"{root / version}/manifest.json: draft_dir is not a path string")
    model_dir = manifest.draft_path(path).resolve()
    for what, where in ((root / version, path), (f"its draft_dir {draft_dir!r}", model_dir)):
        if not where.is_relative_to(inside):
            raise OutsideRootError(
                f"{root / version}: {what} resolves to {where}, outside the drafts root "
                f"{inside}; only the root's own versions are loaded"
            )
    return model_dir
