"""Where the server's draft comes from: one directory (--draft), none, or a published root
(--drafts) that is watched for new versions (hot swap).

A published root:

    ROOT/v000001/            a draft directory (standalone HF dir or EAGLE-3 head) + manifest.json
    ROOT/v000002/
    ROOT/current             one line naming the version served, e.g. "v000002"; replaced
                             atomically (specdistill.publish.atomic_write_text)

`DraftWatcher` polls `current` every `poll_s` seconds; a version it has not seen is loaded
beside the running one, checked against the target (tokenizer or vocabulary) and handed to
the worker, which switches between rounds. Loading is all or nothing (drafts.hub): a version
whose weights do not cover its config, or whose weights file is cut short, does not load. A
version that fails to load or to match is logged and skipped (not retried until `current`
names it again after another version), and the previous one keeps serving.
"""

import dataclasses
import json
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from specdistill import drafts
from specdistill.drafts.hub import check_tokenizers, load_draft, load_tokenizer
from specdistill.errors import UserError

log = logging.getLogger("specdistill.serve")
# A version's name: "v" and six digits, numbered from v000001 (`version_name`).
VERSION = re.compile(r"^v(\d{6})$")


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
    target: dict | None = None  # {"name", "identity"} (specdistill.drafts.identity)
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


def load_checked(path: str, target, tokenizer, *, dtype: str = "float32"):
    """A draft loaded from `path`, on the target's device, checked to fit the target."""
    draft = load_draft(path, dtype=dtype)
    kind = drafts.type_of(draft)
    if kind.own_tokenizer:
        check_tokenizers(tokenizer, load_tokenizer(path), "target", path)
    head = kind.vocab_size_of(draft)
    if kind.own_tokenizer and head < len(tokenizer):
        raise UserError(f"{path}: the draft's head has {head} rows, the tokenizer {len(tokenizer)}")
    if not kind.own_tokenizer and head > len(tokenizer):
        raise UserError(
            f"{path}: the {kind.name} draft covers {head} token ids; the target's tokenizer "
            f"has {len(tokenizer)}: it was trained for another target"
        )
    if not kind.own_tokenizer:
        hidden = getattr(getattr(draft, "config", None), "target_hidden_size", None)
        if hidden is not None and hidden != target.config.hidden_size:
            raise UserError(
                f"{path}: head built for hidden size {hidden}, target has "
                f"{target.config.hidden_size}"
            )
    return draft.to(target.device)


def read_current(root: Path) -> str | None:
    """The version ROOT/current names (None when there is no such file or it is empty)."""
    try:
        name = (root / "current").read_text().strip()
    except FileNotFoundError:
        return None
    return name or None


def read_manifest(version_dir: Path) -> Manifest:
    """The version's manifest (an empty one when it has no manifest.json)."""
    try:
        return Manifest.from_dict(json.loads((version_dir / "manifest.json").read_text()))
    except FileNotFoundError:
        return Manifest()


class DraftWatcher(threading.Thread):
    """Polls ROOT/current; loads each new version and calls `install(draft, version)`."""

    def __init__(
        self, root, target, tokenizer, install, *, poll_s: float = 2.0, dtype: str = "float32"
    ):
        super().__init__(name="specdistill-drafts", daemon=True)
        self.root = Path(root)
        self.target, self.tokenizer = target, tokenizer
        self.install, self.poll_s, self.dtype = install, poll_s, dtype
        self.loaded: str | None = None
        self.last_seen: str | None = None
        self.failed: dict[str, str] = {}  # version -> why it was skipped
        self.stopping = threading.Event()

    def load(self, version: str):
        """The draft of `version`, checked; raises on any problem."""
        if not VERSION.match(version):
            raise UserError(f"current names {version!r}, not a version like v000001")
        path = self.root / version
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: no such version directory")
        model_dir = read_manifest(path).draft_path(path)
        return load_checked(str(model_dir), self.target, self.tokenizer, dtype=self.dtype)

    def poll(self) -> tuple[object, str] | None:
        """Check `current` once: (draft, version) when a new good version was loaded."""
        version = read_current(self.root)
        if version is None or version == self.loaded:
            self.last_seen = version
            return None
        if version in self.failed and version == self.last_seen:
            return None  # skipped already; retried only if named again after another
        self.last_seen = version
        try:
            draft = self.load(version)
        except Exception as e:  # noqa: BLE001 - any failure: skip, keep the old version
            self.failed[version] = f"{type(e).__name__}: {e}"
            log.error("draft version %s skipped: %s; still serving %s", version, e, self.loaded)
            return None
        self.failed.pop(version, None)
        self.loaded = version
        return draft, version

    def run(self) -> None:
        while not self.stopping.wait(self.poll_s):
            found = self.poll()
            if found is not None:
                self.install(*found)

    def stop(self) -> None:
        self.stopping.set()
