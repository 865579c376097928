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

import json
import logging
import re
import threading
from pathlib import Path

from specdistill import drafts
from specdistill.drafts.hub import check_tokenizers, load_draft, load_tokenizer

log = logging.getLogger("specdistill.serve")
VERSION = re.compile(r"^v\d{6}$")


def load_checked(path: str, target, tokenizer, *, dtype: str = "float32"):
    """A draft loaded from `path`, on the target's device, checked to fit the target."""
    draft = load_draft(path, dtype=dtype)
    kind = drafts.type_of(draft)
    if kind.own_tokenizer:
        check_tokenizers(tokenizer, load_tokenizer(path), "target", path)
    head = kind.vocab_size_of(draft)
    if kind.own_tokenizer and head < len(tokenizer):
        raise ValueError(
            f"{path}: the draft's head has {head} rows, the tokenizer {len(tokenizer)}"
        )
    if not kind.own_tokenizer and head > len(tokenizer):
        raise ValueError(
            f"{path}: the {kind.name} draft covers {head} token ids; the target's tokenizer "
            f"has {len(tokenizer)}: it was trained for another target"
        )
    if not kind.own_tokenizer:
        hidden = getattr(getattr(draft, "config", None), "target_hidden_size", None)
        if hidden is not None and hidden != target.config.hidden_size:
            raise ValueError(
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


def read_manifest(version_dir: Path) -> dict:
    try:
        return json.loads((version_dir / "manifest.json").read_text())
    except FileNotFoundError:
        return {}


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
            raise ValueError(f"current names {version!r}, not a version like v000001")
        path = self.root / version
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: no such version directory")
        manifest = read_manifest(path)
        model_dir = path / manifest["draft_dir"] if manifest.get("draft_dir") else path
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
