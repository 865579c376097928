"""The online job's input: record screening and the bounded training store (recent records,
a reservoir of older ones, an anchor set, the held-out newest slice). Everything here is
plain data that `state()` / `from_state()` turn into JSON, so that the job can commit it
atomically with each refresh (train/online/job.py). The cursor over the traffic shards is
train/online/cursor.py (re-exported here).
"""

import hashlib
import json
import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specdistill.data.tokenize import Tokens
from specdistill.serve.traffic import SHARD, TrafficError, check, describe, shards
from specdistill.train.online.cursor import Cursor, read_new

SKIP_REASONS = ("client",)  # screened out by choice: counted, not written to rejects.jsonl
# A positive temperature below MIN_TEMPERATURE overflows logits / T in low precision (the
# schema's own range, `serve.traffic.TEMPERATURE`, bounds it above). 0 is greedy.
MIN_TEMPERATURE = 1e-4
MAX_ID_CHARS = 256  # a record's id and category: kept in the state, keys of the gate's groups
# The reject reason of a schema error found under a field (any error, its type included);
# elsewhere an out-of-range value of these fields has its own reason, everything else is
# "schema". Errors of a reason other than "schema" are reported after the target's checks.
REASON_OF_FIELD = {"sampling": "sampling", "speculative": "speculative"}
RANGE_REASONS = {"top_logprobs": "top_logprobs"}
RANGE_ERRORS = ("out_of_range", "too_short")
TYPE_REASONS = {"top_logprobs_range": "top_logprobs"}  # the record's own cross-field checks


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} overflows a float")
    return value


def parse_line(raw: bytes):
    """json.loads, strict: NaN, Infinity and numbers that overflow a float are refused (a
    ValueError, as for any malformed line); so is nesting too deep for the parser."""
    try:
        return json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _reason(error: dict) -> str:
    """The reject reason of one of `TrafficRecord`'s validation errors."""
    loc = error["loc"]
    if error["type"] in TYPE_REASONS:
        return TYPE_REASONS[error["type"]]
    if error["type"] == "missing" or not loc:
        return "schema"
    if loc[0] in REASON_OF_FIELD:
        return REASON_OF_FIELD[loc[0]]
    if error["type"] in RANGE_ERRORS:
        return RANGE_REASONS.get(loc[0], "schema")
    return "schema"


def _policy_problem(record: dict, vocab_size: int) -> tuple[str, str] | None:
    """(reason, detail) for what follows the schema but the job cannot keep or train on: an
    empty or over-long id or category, a positive temperature too small for low precision, a
    token id outside the target's vocabulary."""
    if not 0 < len(record["id"]) <= MAX_ID_CHARS:
        return "schema", f"id of {len(record['id'])} characters (1 to {MAX_ID_CHARS})"
    if record["category"] is not None and len(record["category"]) > MAX_ID_CHARS:
        return "schema", f"category of {len(record['category'])} characters (> {MAX_ID_CHARS})"
    t = record["sampling"]["temperature"]
    if 0 < t < MIN_TEMPERATURE:
        return "sampling", f"sampling.temperature {t!r} is not 0 or >= {MIN_TEMPERATURE:g}"
    ids = record["prompt_token_ids"] + record["completion_token_ids"]
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        return "token_out_of_range", f"ids must be in [0, {vocab_size})"
    for i, entry in enumerate(record["top_logprobs"] or ()):
        bad = [t_id for t_id, _ in entry if not 0 <= t_id < vocab_size]
        if bad:
            return "top_logprobs", f"top_logprobs[{i}]: id {bad[0]!r} not in [0, {vocab_size})"
    return None


def screen(raw: bytes, identity: str, *, max_tokens: int, vocab_size: int, clients=None):
    """(record, None, "") for a usable line, or (record or None, reason, detail) otherwise.

    Never raises: any line (bytes of any kind, JSON of any shape) gets a reason. The record
    is validated against the traffic schema (`serve.traffic.TrafficRecord`: types, finite
    numbers, sampling and speculative ranges, top_logprobs shape), then against the job: its
    target, its token budget and vocabulary, the clients it trains on.
    `clients`: a set of client ids; a record from another client (or none) gets the reason
    "client" (one of SKIP_REASONS). None or empty: every client."""
    if not raw.strip():
        return None, "blank_line", ""
    try:
        parsed = parse_line(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN, overflow, depth
        return None, "malformed_json", str(e)[:500]
    record = parsed if isinstance(parsed, dict) else None
    try:
        _, errors = check(parsed)
    except (TypeError, ValueError, OverflowError) as e:  # a shape no validator foresaw
        return record, "schema", str(e)[:500]
    found = [(_reason(e), describe(e)[:500]) for e in errors]
    schema = [f for f in found if f[0] == "schema"]
    if schema:
        return record, *schema[0]
    client = record.get("client")
    if clients and client not in clients:
        return record, "client", f"client {client!r} is not in online.clients"
    target = record.get("target")
    if target["identity"] != identity:
        return (
            record,
            "target_identity",
            (
                f"record of target {target['name']!r} ({target['identity']}), "
                f"job's target is {identity}"
            ),
        )
    n_prompt, n_completion = len(record["prompt_token_ids"]), len(record["completion_token_ids"])
    if n_completion == 0:
        return record, "empty_completion", ""
    if n_prompt == 0:
        return record, "empty_prompt", ""
    if n_prompt + n_completion > max_tokens:
        return record, "oversized", f"{n_prompt + n_completion} tokens > {max_tokens}"
    if found:
        return record, *found[0]
    problem = _policy_problem(record, vocab_size)
    if problem is not None:
        return record, *problem
    return record, None, ""


def prompt_hash(record: dict) -> str:
    return hashlib.sha256(json.dumps(record["prompt_token_ids"]).encode()).hexdigest()[:32]


def record_key(record: dict) -> str:
    """What makes two records the same: their prompt and completion token ids."""
    ids = [record["prompt_token_ids"], record["completion_token_ids"]]
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:32]


def compact(record: dict, top_logprobs: bool = False) -> dict:
    """What the store keeps of a record: enough to train and evaluate on it (and its
    top_logprobs when `top_logprobs`: online.sparse_targets)."""
    item = {
        "id": record["id"],
        "time": record["time"],
        "prompt_token_ids": record["prompt_token_ids"],
        "completion_token_ids": record["completion_token_ids"],
        "temperature": float(record["sampling"]["temperature"]),
        "top_p": record["sampling"].get("top_p"),
        "category": record["category"],
    }
    if top_logprobs and record.get("top_logprobs"):
        item["top_logprobs"] = record["top_logprobs"]
    return item


def to_tokens(item: dict) -> Tokens:
    """Prompt + completion ids; the loss mask is True on the completion tokens."""
    p, c = item["prompt_token_ids"], item["completion_token_ids"]
    ids = np.array(p + c, dtype=np.int32)
    mask = np.zeros(len(ids), dtype=bool)
    mask[len(p) :] = True
    mask[0] = False
    return Tokens(ids, mask)


@dataclass
class Store:
    """Recent records (bounded), a reservoir sample of older ones, the anchor set, and the
    held-out newest slice. A record enters `holdout` first; the one it pushes out (older)
    becomes trainable: `new` (not yet trained) and `recent`; the one `recent` pushes out goes
    to the reservoir (Algorithm R).

    Two rules at the door: an exact repeat (the same prompt and completion, by `record_key`,
    among the last `dedup_size` records) is dropped, and a prompt already held
    `max_per_prompt` times (holdout, recent and reservoir together) is dropped, so repeats
    of a popular prompt with other completions (sampled requests) are trained, up to a share
    that keeps one hot prompt from dominating the replay."""

    recent_size: int
    reservoir_size: int
    holdout_size: int
    dedup_size: int
    max_per_prompt: int = 4
    holdout: deque = field(default_factory=deque)
    recent: deque = field(default_factory=deque)
    new: list = field(default_factory=list)  # trainable records not yet trained
    reservoir: list = field(default_factory=list)
    reservoir_seen: int = 0  # records offered to the reservoir
    anchor: list = field(default_factory=list)
    seen: deque = field(default_factory=deque)  # record keys, oldest first
    seen_set: set = field(default_factory=set)
    held: Counter = field(default_factory=Counter)  # prompt hash -> records of it held
    rng_state: int = 0  # the reservoir's RNG seed for the next draw

    def add(self, item: dict, key: str) -> str | None:
        """None when `item` is stored; else why not: "duplicate" (an exact repeat) or
        "prompt_cap" (its prompt is held `max_per_prompt` times already)."""
        if key in self.seen_set:
            return "duplicate"
        phash = prompt_hash(item)
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

    def _release(self, item: dict) -> None:
        phash = prompt_hash(item)
        self.held[phash] -= 1
        if self.held[phash] <= 0:
            del self.held[phash]

    def _to_recent(self, item: dict) -> None:
        self.recent.append(item)
        self.new.append(item)
        while len(self.recent) > self.recent_size:
            old = self.recent.popleft()
            self._offer_reservoir(old)

    def _offer_reservoir(self, item: dict) -> None:
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

    def new_items(self) -> list[dict]:
        """The trainable records not trained yet (all in `recent`, or pushed beyond it)."""
        return list(self.new)

    def refresh_mix(self, n_total: int, recent_ratio: float, anchor_ratio: float, seed: int):
        """(new items, replay items): every new record once, plus replay drawn from the other
        recent records (to `recent_ratio` of n_total), the reservoir and the anchor set."""
        rng = random.Random(seed)
        fresh = self.new_items()
        fresh_ids = {it["id"] for it in fresh}
        n_total = max(n_total, len(fresh))
        n_recent = max(len(fresh), round(recent_ratio * n_total))
        others = [it for it in self.recent if it["id"] not in fresh_ids]
        replay = rng.sample(others, min(len(others), n_recent - len(fresh)))
        n_old = n_total - len(fresh) - len(replay)
        n_anchor = min(len(self.anchor), round(anchor_ratio * n_old)) if self.anchor else 0
        pool = [it for it in self.reservoir if it["id"] not in fresh_ids]
        replay += rng.sample(pool, min(len(pool), n_old - n_anchor))
        replay += rng.sample(self.anchor, n_anchor)
        return fresh, replay

    def mark_trained(self, ids) -> None:
        done = set(ids)
        self.new = [it for it in self.new if it["id"] not in done]

    def state(self) -> dict:
        return {
            "holdout": list(self.holdout),
            "recent": list(self.recent),
            "new": self.new,
            "reservoir": self.reservoir,
            "reservoir_seen": self.reservoir_seen,
            "seen": list(self.seen),
            "rng_state": self.rng_state,
        }

    def load(self, state: dict) -> None:
        self.holdout = deque(state["holdout"])
        self.recent = deque(state["recent"])
        self.new = list(state["new"])
        self.reservoir = list(state["reservoir"])
        self.reservoir_seen = state["reservoir_seen"]
        self.seen = deque(state["seen"])
        self.seen_set = set(self.seen)
        self.held = Counter(
            prompt_hash(it) for it in (*self.holdout, *self.recent, *self.reservoir)
        )
        self.rng_state = state["rng_state"]


def load_anchor(sources: list[str], identity: str, max_tokens: int, vocab_size: int) -> list:
    """The anchor set: the usable records of traffic directories or .jsonl files."""
    items = []
    for source in sources:
        path = Path(source)
        files = shards(path) if path.is_dir() else [path]
        for f in files:
            for raw in f.read_bytes().split(b"\n"):
                record, reason, *_ = screen(
                    raw, identity, max_tokens=max_tokens, vocab_size=vocab_size
                )
                if reason is None:
                    items.append(compact(record))
    return items


def count_reasons(counter: Counter) -> dict:
    return dict(counter.most_common())


__all__ = ["SHARD", "Cursor", "Store", "compact", "load_anchor", "read_new", "screen", "to_tokens"]


# ----------------------------------------------------------------------------- sparse targets
class RecordTargets:
    """The target of a refresh taken from its records' own `top_logprobs` (the target's raw
    top-k at temperature 1, docs/traffic.md) instead of a forward of the target: each position
    a `SparseTarget` of the k logged tokens plus a rest bin holding 1 − Σ p (docs/theory.md
    §3). The interface of `train.target_cache.TargetCache` (`depths`), which the Trainer uses in
    place of the live target; rows are found by `batch["sequence"]`, indices into `items`."""

    def __init__(self, items: list[dict]):
        self.items = items

    def depths(self, draft, batch: dict, vocab_size: int, split: str = "train"):
        from specdistill.drafts.align import shifted_logits, target_mask

        mask = target_mask(batch)
        rows = [self.items[i] for i in batch["sequence"].tolist()]
        target = sparse_target(rows, mask, vocab_size)
        return [shifted_logits(draft, batch, vocab_size)], [target], [mask]


def sparse_target(items: list[dict], mask, vocab_size: int):
    """SparseTarget [B, L−1, k] with rest [B, L−1] from the items' top_logprobs, one entry per
    completion token, placed at the valid positions of `mask` (those predicting a completion
    token, in order; train.target_cache.place_sparse_rows). Entries with fewer than k alternatives
    are padded with unused ids of probability 0."""
    import torch

    from specdistill.train.target_cache import place_sparse_rows

    k = max(len(entry) for it in items for entry in it["top_logprobs"])
    rows = []
    for it in items:
        entries = it["top_logprobs"]
        if not it["prompt_token_ids"]:  # to_tokens: the first token is never a target
            entries = entries[1:]
        indices, probs = [], []
        for entry in entries:
            ids = [int(t) for t, _ in entry]
            taken = set(ids)
            if len(taken) != len(ids) or not all(0 <= t < vocab_size for t in ids):
                raise TrafficError(
                    f"record {it.get('id')}: top_logprobs ids must be distinct and in "
                    f"[0, {vocab_size})"
                )
            unused = (t for t in range(vocab_size) if t not in taken)
            indices.append(ids + [next(unused) for _ in range(k - len(ids))])
            probs.append([float(np.exp(lp)) for _, lp in entry] + [0.0] * (k - len(entry)))
        p = torch.tensor(probs, dtype=torch.float32).reshape(len(entries), k)
        rest = (1.0 - p.sum(-1)).clamp_min(0.0)
        rows.append((torch.tensor(indices, dtype=torch.long).reshape(len(entries), k), p, rest))

    def mismatch(b: int, have: int, want: int) -> Exception:
        return TrafficError(
            f"record {items[b].get('id')}: {have} top_logprobs entries for {want} trained "
            "completion tokens"
        )

    return place_sparse_rows(mask, k, rows, mismatch)
