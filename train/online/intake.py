"""The online job's input side: reading the traffic after the cursor (train/online/cursor.py),
screening each line (train/online/screen.py), filing what the store keeps of the usable
records (train/online/kept.py) into the store, and logging what was refused
(OUT/rejects.jsonl), skipped by choice (counted only) or found wrong with the shards (a
warning and a metric). The job (train/online/job.py) composes it with the other parts."""

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdistill.errors import UserFileError
from specdistill.train.online.context import Context, max_tokens
from specdistill.train.online.cursor import Cursor, read_new
from specdistill.train.online.kept import KeptRecord
from specdistill.train.online.screen import SKIP_REASONS, screen
from specdistill.train.online.watch import Watch


@dataclass(eq=False)
class Intake:
    """The traffic, read into the shared store and counters (`ctx`). Its own state: the
    position in the shards (`cursor`) and the served α watched (`watch`), both committed
    with the job's state, and the warnings given once."""

    ctx: Context
    cursor: Cursor = field(default_factory=Cursor)
    watch: Watch = field(init=False)
    clients: set[str] = field(init=False)  # online.clients: records of others are skipped
    max_tokens: int = field(init=False)  # a record's token budget
    _said: set[str] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        o = self.ctx.online
        self.watch = Watch(o.watch_window, o.watch_trailing, o.watch_drop)
        self.clients = set(o.clients or ())
        self.max_tokens = max_tokens(self.ctx.recipe)

    def state(self) -> dict:
        """The intake's part of the committed state."""
        return {"cursor": self.cursor.as_dict(), "watch": self.watch.state()}

    def load(self, state: dict) -> None:
        self.cursor = Cursor.from_dict(state["cursor"])
        self.watch.load(state["watch"])

    def _reject(self, reason: str, detail: str, shard, offset, raw, line_id=None) -> None:
        self.ctx.counts[f"rejected/{reason}"] += 1
        self.ctx.log(
            "rejects.jsonl",
            {
                "reason": reason,
                "detail": detail,
                "shard": shard,
                "offset": offset,
                "id": line_id,
                "line": raw[:2000].decode("utf-8", "replace") if raw else None,
            },
        )

    def read(self) -> int:
        """Consume the complete lines after the cursor, up to the point a refresh is due;
        returns the number of new records stored."""
        o, store = self.ctx.online, self.ctx.store
        added = 0
        for shard, offset, raw, reason in read_new(o.traffic, self.cursor, o.max_line_bytes):
            if reason in ("shard_rewritten", "shard_gone"):
                self._shard_event(reason, shard)
                continue
            if reason == "not_a_shard":
                self._not_a_shard(shard)
                continue
            self.ctx.counts["lines"] += 1
            if raw is None:
                self._reject(reason, "", shard, offset, None)
            else:
                added += self._take(shard, offset, raw)
            self.ctx.faults("read:line")
            if len(store.new) >= o.refresh_records:
                break  # refresh first: every refresh_records records, however many wait
        self.cursor.seal(o.traffic)
        return added

    def _take(self, shard: str, offset: int, raw: bytes) -> int:
        """Screen one line and file its record: 1 when the store took it, else 0."""
        ctx = self.ctx
        screened = screen(
            raw,
            ctx.identity,
            max_tokens=self.max_tokens,
            vocab_size=ctx.vocab_size,
            clients=self.clients,
        )
        reason = screened.reason
        if reason == "blank_line":
            ctx.counts["blank_lines"] += 1
            return 0
        if reason in SKIP_REASONS:  # by choice, not a fault: counted, not logged
            ctx.counts[f"skipped/{reason}"] += 1
            return 0
        if reason is not None:
            self._reject(reason, screened.detail, shard, offset, raw, screened.id)
            return 0
        ctx.counts["records_seen"] += 1
        metric = self.watch.add(screened.record)
        if metric is not None:
            self._watch_metric(metric)
        refused = ctx.store.add(KeptRecord.of(screened.record, ctx.online.sparse_targets))
        if refused is not None:  # "duplicate" (an exact repeat) or "prompt_cap"
            ctx.counts[refused] += 1
            return 0
        ctx.counts["records_accepted"] += 1
        return 1

    def _shard_event(self, what: str, shard: str) -> None:
        """A shard changed under the cursor: a warning naming it, a count and a metric."""
        path = Path(self.ctx.online.traffic) / shard
        if what == "shard_rewritten":
            how = (
                "was rewritten or truncated under the cursor; reading it again from its "
                "start (records already taken are refused as exact repeats)"
            )
        else:
            how = "has gone before it was read to its end; reading on from the next shard"
        self.ctx.counts[what] += 1
        self.ctx.print(f"WARNING online: {path} {how}", file=sys.stderr)
        self.ctx.log("metrics.jsonl", {"kind": what, "shard": shard, "time": time.time()})

    def _not_a_shard(self, name: str) -> None:
        """A shard's name on a directory, a device or a symlink leading out of the traffic
        directory: skipped, with a warning and a count once per job."""
        if f"not_a_shard/{name}" in self._said:
            return
        self._said.add(f"not_a_shard/{name}")
        self.ctx.counts["not_a_shard"] += 1
        path = Path(self.ctx.online.traffic) / name
        self.ctx.print(
            f"WARNING online: {path} is not a regular file inside {self.ctx.online.traffic} (a "
            "directory, a device, or a symlink leading out of it); skipped",
            file=sys.stderr,
        )
        self.ctx.log("metrics.jsonl", {"kind": "not_a_shard", "shard": name, "time": time.time()})

    def check_traffic(self, follow: bool) -> None:
        """A missing online.traffic is an error in a one-pass run, and a warning (once) in a
        follow run, which waits for the server to create it."""
        d = Path(self.ctx.online.traffic)
        if d.exists() and not d.is_dir():
            raise UserFileError(
                f"online.traffic {d} is a file, not the server's --traffic directory"
            )
        if d.is_dir():
            return
        if not follow:
            raise FileNotFoundError(
                f"online.traffic {d}: no such directory (the server's --traffic directory); "
                "check the path, or run with --follow to wait for the server to create it"
            )
        if "traffic" not in self._said:
            self._said.add("traffic")
            self.ctx.print(
                f"WARNING online: online.traffic {d} does not exist yet; waiting for the "
                "server to create it",
                file=sys.stderr,
            )

    def _watch_metric(self, metric: dict) -> None:
        metric["time"] = time.time()
        self.ctx.log("metrics.jsonl", metric)
        for line in metric["alerts"]:
            self.ctx.print(f"ALERT online watch: {line}", file=sys.stderr)
