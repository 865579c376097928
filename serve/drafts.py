"""Where the server's draft comes from: one directory (--draft), none, or a published root
(--drafts) that is watched for new versions (hot swap).

A published root: ROOT/vNNNNNN/ versions and ROOT/current naming the one served
(formats/published.py).

`DraftWatcher` polls `current` every `poll_s` seconds; a version it has not seen is loaded
beside the running one, checked against the target (tokenizer or vocabulary,
drafts/checked_load.py) and handed to the worker, which switches between rounds. Loading is
all or nothing (models.hub): a version whose weights do not cover its config, or whose
weights file is cut short, does not load. A version that fails to load or to match is logged
and skipped (not retried until `current` names it again after another version), and the
previous one keeps serving.

Only ROOT's own versions load: a version directory, or a manifest's `draft_dir`, that
resolves outside ROOT is refused. A version's config is checked against its weight files'
headers before the model is built (`check_before_loading`), so a config of other shapes
allocates nothing. A `current` that cannot be read (not UTF-8, a directory, a symlink loop)
never stops the watcher: each failed poll is logged (once per distinct problem), counted and
retried at the next poll; `health()` and the `WatchMetrics` collector show it in /health and
/metrics.
"""

import logging
import threading
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specdistill.drafts.checked_load import load_checked
from specdistill.errors import UserError
from specdistill.formats.published import VERSION, read_current, version_draft_dir

log = logging.getLogger("specdistill.serve")


class DraftWatcher(threading.Thread):
    """Polls ROOT/current; loads each new version and calls `install(draft, version)`."""

    def __init__(self, root, target, tokenizer, install, *, poll_s: float, dtype: str):
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
