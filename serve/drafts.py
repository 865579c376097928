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

Only ROOT's own versions load: a version directory, or a manifest's `draft_dir`, that
resolves outside ROOT is refused. A version's config is checked against its weight files'
headers before the model is built (`check_before_loading`), so a config of other shapes
allocates nothing. A `current` that cannot be read (not UTF-8, a directory, a symlink loop)
never stops the watcher: each failed poll is logged (once per distinct problem), counted and
retried at the next poll; `health()` and the `WatchMetrics` collector show it in /health and
/metrics.
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


class CurrentUnreadableError(UserError):
    """ROOT/current exists but cannot be read as a version name (not UTF-8, not a file)."""


class OutsideRootError(UserError):
    """A version (or its manifest's draft_dir) that resolves outside the drafts root."""


def implied_shapes(path: str) -> tuple[dict[str, tuple], list[set[str]]]:
    """(name -> shape of every tensor the config at `path` implies, groups of names sharing
    one tensor), from the model built on the meta device: nothing is allocated."""
    import torch

    from specdistill.drafts.eagle3_head import Eagle3Head, is_eagle3_dir

    with torch.device("meta"):
        if is_eagle3_dir(path):
            model = _meta_eagle3(Eagle3Head, Path(path))
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    state = model.state_dict(keep_vars=True)
    groups: dict[int, set[str]] = {}
    for name, tensor in state.items():
        groups.setdefault(id(tensor), set()).add(name)
    tied = [names for names in groups.values() if len(names) > 1]
    return {name: tuple(t.shape) for name, t in state.items()}, tied


def _meta_eagle3(cls, directory: Path):
    """An EAGLE-3 head of the speculators config in `directory`, under the caller's device
    context."""
    from specdistill.drafts.eagle3_format import head_from_config

    return head_from_config(cls, json.loads((directory / "config.json").read_text()))


def check_before_loading(path: str) -> None:
    """Refuse (`IncompleteDraftError`) a local draft directory whose weight files' headers
    lack tensors its config implies or hold them in other shapes, before any tensor is
    allocated."""
    from specdistill.drafts.weights import check_header_shapes

    if not (Path(path) / "config.json").is_file():
        return  # not a local model directory: the loader says what it is
    shapes, tied = implied_shapes(path)
    check_header_shapes(path, shapes, tied)


def load_checked(path: str, target, tokenizer, *, dtype: str = "float32"):
    """A draft loaded from `path`, on the target's device, checked to fit the target; its
    config's shapes are checked against its weights before the model is built."""
    check_before_loading(path)
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
        self.errors = 0  # polls that failed (current unreadable, or any other error)
        self.error: str | None = None  # the last poll's problem (None: it went well)
        self.stopping = threading.Event()

    def load(self, version: str):
        """The draft of `version`, checked; raises on any problem."""
        if not VERSION.match(version):
            raise UserError(f"current names {version!r}, not a version like v000001")
        path = self.root / version
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: no such version directory")
        model_dir = version_draft_dir(self.root, version)
        return load_checked(str(model_dir), self.target, self.tokenizer, dtype=self.dtype)

    def poll(self) -> tuple[object, str] | None:
        """Check `current` once: (draft, version) when a new good version was loaded. A
        `current` that cannot be read is a failed poll (`note_error`), retried at the next."""
        try:
            version = read_current(self.root)
        except Exception as e:  # noqa: BLE001 - any read error: keep serving, poll again
            self.note_error(e)
            return None
        self.error = None
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

    def note_error(self, error: BaseException) -> None:
        """Count a failed poll; log it when its problem differs from the last poll's."""
        why = f"{type(error).__name__}: {error}"
        self.errors += 1
        if why != self.error:
            log.error("%s: draft watch poll failed (%s); still serving %s; retrying every "
                      "%gs", self.root, why, self.loaded, self.poll_s)  # fmt: skip
        self.error = why

    def step(self) -> None:
        """One poll and, for a new good version, its install; never raises."""
        try:
            found = self.poll()
            if found is not None:
                self.install(*found)
        except Exception as e:  # noqa: BLE001 - the watcher outlives any one poll
            self.note_error(e)

    def run(self) -> None:
        while not self.stopping.wait(self.poll_s):
            self.step()

    def stop(self) -> None:
        self.stopping.set()

    def health(self) -> dict:
        """The watch's state for /health: healthy unless the last poll failed or the thread
        died after it was started."""
        dead = self.ident is not None and not self.is_alive() and not self.stopping.is_set()
        return {
            "ok": self.error is None and not dead,
            "root": str(self.root),
            "loaded": self.loaded,
            "errors": self.errors,
            "error": "the draft watcher stopped" if dead else self.error,
            "skipped": dict(self.failed),
        }


class WatchMetrics:
    """A Prometheus collector of a DraftWatcher: failed polls (a counter) and whether the
    last one failed (a gauge)."""

    def __init__(self, watcher: DraftWatcher):
        self.watcher = watcher

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        w = self.watcher
        yield CounterMetricFamily(
            "specdistill:draft_watch_errors",
            "Polls of the drafts root that failed (current unreadable, a load that raised).",
            value=w.errors,
        )
        yield GaugeMetricFamily(
            "specdistill:draft_watch_failing",
            "1 while the last poll of the drafts root failed, else 0.",
            value=0 if w.health()["ok"] else 1,
        )
