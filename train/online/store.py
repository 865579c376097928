"""The online job's training store: recent records (bounded), a reservoir of older ones, an
anchor set and the held-out newest slice, each a `KeptRecord` (train/online/kept.py). It is
plain data that `state()` / `load()` turn into JSON, so that the job can commit it atomically
with each refresh (train/online/job.py).
"""

import random
from collections import Counter, deque
from dataclasses import dataclass, field

from specdistill.train.online.kept import KeptRecord


@dataclass
class Store:
    """Recent records (bounded), a reservoir sample of older ones, the anchor set, and the
    held-out newest slice. A record enters `holdout` first; the one it pushes out (older)
    becomes trainable: `new` (not yet trained) and `recent`; the one `recent` pushes out goes
    to the reservoir (Algorithm R).

    Two rules at the door: an exact repeat (the same prompt and completion, `KeptRecord.key`,
    among the last `dedup_size` records) is dropped, and a prompt already held
    `max_per_prompt` times (holdout, recent and reservoir together) is dropped, so repeats
    of a popular prompt with other completions (sampled requests) are trained, up to a share
    that keeps one hot prompt from dominating the replay."""

    recent_size: int
    reservoir_size: int
    holdout_size: int
    dedup_size: int
    max_per_prompt: int = 4
    holdout: deque[KeptRecord] = field(default_factory=deque)
    recent: deque[KeptRecord] = field(default_factory=deque)
    new: list[KeptRecord] = field(default_factory=list)  # trainable records not yet trained
    reservoir: list[KeptRecord] = field(default_factory=list)
    reservoir_seen: int = 0  # records offered to the reservoir
    anchor: list[KeptRecord] = field(default_factory=list)
    seen: deque[str] = field(default_factory=deque)  # record keys, oldest first
    seen_set: set[str] = field(default_factory=set)
    held: Counter = field(default_factory=Counter)  # prompt hash -> records of it held
    rng_state: int = 0  # the reservoir's RNG seed for the next draw

    def add(self, item: KeptRecord) -> str | None:
        """None when `item` is stored; else why not: "duplicate" (an exact repeat) or
        "prompt_cap" (its prompt is held `max_per_prompt` times already)."""
        key = item.key()
        if key in self.seen_set:
            return "duplicate"
        phash = item.prompt_hash()
        if self.held[phash] >= self.max_per_prompt:
            return "prompt_cap"
        self.seen.append(key)
        self.seen_set.add(key)
        while len(self.seen) > self.dedup_size:
            self.seen_set.discard(self.seen.popleft())
        self.held[phash] += 1
        self.holdout.append(item)
        while len(self.holdout) > self.holdout_size:
            self._to_recent(self.holdout.popleft())
        return None

    def _release(self, item: KeptRecord) -> None:
        phash = item.prompt_hash()
        self.held[phash] -= 1
        if self.held[phash] <= 0:
            del self.held[phash]

    def _to_recent(self, item: KeptRecord) -> None:
        self.recent.append(item)
        self.new.append(item)
        while len(self.recent) > self.recent_size:
            old = self.recent.popleft()
            self._offer_reservoir(old)

    def _offer_reservoir(self, item: KeptRecord) -> None:
        if self.reservoir_size == 0:
            self._release(item)
            return
        self.reservoir_seen += 1
        rng = random.Random(self.rng_state * 1_000_003 + self.reservoir_seen)
        if len(self.reservoir) < self.reservoir_size:
            self.reservoir.append(item)
        else:
            j = rng.randrange(self.reservoir_seen)
            if j < self.reservoir_size:
                self._release(self.reservoir[j])
                self.reservoir[j] = item
            else:
                self._release(item)

    def new_items(self) -> list[KeptRecord]:
        """The trainable records not trained yet (all in `recent`, or pushed beyond it)."""
        return list(self.new)

    def refresh_mix(
        self, n_total: int, recent_ratio: float, anchor_ratio: float, seed: int
    ) -> tuple[list[KeptRecord], list[KeptRecord]]:
        """(new items, replay items): every new record once, plus replay drawn from the other
        recent records (to `recent_ratio` of n_total), the reservoir and the anchor set."""
        rng = random.Random(seed)
        fresh = self.new_items()
        fresh_ids = {it.id for it in fresh}
        n_total = max(n_total, len(fresh))
        n_recent = max(len(fresh), round(recent_ratio * n_total))
        others = [it for it in self.recent if it.id not in fresh_ids]
        replay = rng.sample(others, min(len(others), n_recent - len(fresh)))
        n_old = n_total - len(fresh) - len(replay)
        n_anchor = min(len(self.anchor), round(anchor_ratio * n_old)) if self.anchor else 0
        pool = [it for it in self.reservoir if it.id not in fresh_ids]
        replay += rng.sample(pool, min(len(pool), n_old - n_anchor))
        replay += rng.sample(self.anchor, n_anchor)
        return fresh, replay

    def mark_trained(self, ids) -> None:
        done = set(ids)
        self.new = [it for it in self.new if it.id not in done]

    def state(self) -> dict:
        return {
            "holdout": _dicts(self.holdout),
            "recent": _dicts(self.recent),
            "new": _dicts(self.new),
            "reservoir": _dicts(self.reservoir),
            "reservoir_seen": self.reservoir_seen,
            "seen": list(self.seen),
            "rng_state": self.rng_state,
        }

    def load(self, state: dict) -> None:
        self.holdout = deque(_records(state["holdout"]))
        self.recent = deque(_records(state["recent"]))
        self.new = _records(state["new"])
        self.reservoir = _records(state["reservoir"])
        self.reservoir_seen = state["reservoir_seen"]
        self.seen = deque(state["seen"])
        self.seen_set = set(self.seen)
        self.held = Counter(
            it.prompt_hash() for it in (*self.holdout, *self.recent, *self.reservoir)
        )
        self.rng_state = state["rng_state"]


def _dicts(items) -> list[dict]:
    return [it.as_dict() for it in items]


def _records(fields: list[dict]) -> list[KeptRecord]:
    return [KeptRecord.from_dict(f) for f in fields]
