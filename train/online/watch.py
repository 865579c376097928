"""Served α, watched: the records' own speculative statistics (steps, drafted and accepted
tokens), pooled per window of `window` records, overall and per category, and turned into
per-token α (eval.stats.alpha_from_counts; the engines' accepted / drafted rate is reported
beside it as `acceptance_rate`). A window whose α falls more than `drop` below the trailing
level (the mean of the previous `trailing` windows) raises an alert: one line on stderr and
a metric.
"""

from collections import defaultdict

from specdistill.eval.stats import alpha_from_counts
from specdistill.formats.traffic import TrafficRecord


class Watch:
    def __init__(self, window: int, trailing: int, drop: float):
        self.window, self.trailing, self.drop = window, trailing, drop
        self.buffer: list[list] = []  # [accepted, drafted, category, draft_version, steps]
        self.history: list[float] = []  # α of the last windows
        self.cat_history: dict[str, list[float]] = defaultdict(list)
        self.windows = 0

    def add(self, record: TrafficRecord) -> dict | None:
        """Count one served record; the window's metric record when it completes one."""
        spec = record.speculative
        drafted = spec.num_draft_tokens or 0
        if drafted <= 0:
            return None  # decoded without a draft: nothing to measure
        accepted = spec.num_accepted_draft_tokens
        if accepted is None:
            accepted = (spec.draft_acceptance_rate or 0.0) * drafted
        steps = spec.num_spec_steps or 0
        if steps <= 0:
            return None  # counters without steps: τ, hence α, is unknown
        self.buffer.append(
            [
                float(accepted),
                float(drafted),
                record.category or "(none)",
                record.draft_version,
                float(steps),
            ]
        )
        if len(self.buffer) < self.window:
            return None
        return self._close()

    def _close(self) -> dict:
        acc = sum(b[0] for b in self.buffer)
        drafted = sum(b[1] for b in self.buffer)
        steps = sum(b[4] for b in self.buffer)
        alpha = alpha_from_counts(steps, drafted, acc)
        cats = defaultdict(lambda: [0.0, 0.0, 0.0])
        for a, d, c, _, n in self.buffer:
            cats[c][0] += a
            cats[c][1] += d
            cats[c][2] += n
        per_cat = {c: alpha_from_counts(v[2], v[1], v[0]) for c, v in sorted(cats.items())}
        versions = sorted({str(b[3]) for b in self.buffer})
        trail = self.history[-self.trailing :]
        level = sum(trail) / len(trail) if trail else None
        alerts = []
        if level is not None and alpha < level - self.drop:
            alerts.append(
                f"served alpha {alpha:.4f} is {level - alpha:.4f} below its trailing "
                f"level {level:.4f}"
            )
        for c, a in per_cat.items():
            ct = self.cat_history[c][-self.trailing :]
            if ct and a < sum(ct) / len(ct) - self.drop:
                alerts.append(
                    f"category {c}: served alpha {a:.4f} below trailing {sum(ct) / len(ct):.4f}"
                )
            self.cat_history[c].append(a)
        self.history.append(alpha)
        self.history = self.history[-self.trailing :]
        for c in self.cat_history:
            self.cat_history[c] = self.cat_history[c][-self.trailing :]
        self.windows += 1
        self.buffer = []
        return {
            "kind": "watch",
            "window": self.windows,
            "served_alpha": alpha,
            "acceptance_rate": acc / drafted,
            "trailing_alpha": level,
            "per_category": per_cat,
            "draft_versions": versions,
            "alert": bool(alerts),
            "alerts": alerts,
        }

    def state(self) -> dict:
        return {
            "buffer": self.buffer,
            "history": self.history,
            "cat_history": dict(self.cat_history),
            "windows": self.windows,
        }

    def load(self, state: dict) -> None:
        self.buffer = state["buffer"]
        self.history = state["history"]
        self.cat_history = defaultdict(list, state["cat_history"])
        self.windows = state["windows"]
