"""The online demo's results: served α over the traffic records, the windows around the shift
(the last one before it, the first one after it, the recovery, the first one after the
return), their bootstrap intervals, and the plot that marks them."""

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from specdistill.eval.stats import alpha_from_counts, bootstrap_indices, percentile_interval
from specdistill.online_demo.loadgen import PHASES


def served_alpha(records) -> float | None:
    """Per-token α of the served draft over `records` (eval.stats.alpha_from_counts), from
    their summed speculative counters; None without speculative steps."""
    specs = [r["speculative"] for r in records if r.get("speculative")]
    steps = sum(s["num_spec_steps"] for s in specs)
    drafted = sum(s["num_draft_tokens"] for s in specs)
    if not steps or not drafted:
        return None
    return alpha_from_counts(steps, drafted, sum(s["num_accepted_draft_tokens"] for s in specs))


def phase_of(record, starts: list[float]) -> int:
    """1-based phase by the record's time (the time it completed)."""
    phase = 1
    for i, s in enumerate(starts):
        if record["time"] >= s:
            phase = i + 1
    return phase


def phase_means(records, starts: list[float], promotions) -> dict:
    """Served α over whole phases and per version (means that mix the start of a phase with
    its end: the windows below answer what changed at the shift), and in the prose phase by
    the versions promoted before it (`alpha_after_shift_old_versions`) and during it
    (`alpha_after_refresh`; None if none)."""
    by_phase = {p: [r for r in records if phase_of(r, starts) == p] for p in (1, 2, 3)}
    shift_versions = {v for t, v in promotions if len(starts) > 1 and t >= starts[1]}
    per_version: dict[str, list] = {}
    for r in records:
        per_version.setdefault(r["draft_version"], []).append(r)
    return {
        "alpha_after_refresh": served_alpha(
            [r for r in by_phase[2] if r["draft_version"] in shift_versions]
        ),
        "alpha_after_shift_old_versions": served_alpha(
            [r for r in by_phase[2] if r["draft_version"] not in shift_versions]
        ),
        "served_alpha_by_phase": {
            f"{p}_{PHASES[p - 1]}": {"alpha": served_alpha(rs), "records": len(rs)}
            for p, rs in by_phase.items()
        },
        "served_alpha_by_version": {
            v: {"alpha": served_alpha(rs), "records": len(rs)}
            for v, rs in sorted(per_version.items(), key=lambda kv: str(kv[0]))
        },
    }


# ------------------------------------------------------------------------------ windows
@dataclass
class Bootstrap:
    """How the intervals are drawn: `samples` resamples of the records, `confidence` level."""

    samples: int = 1000
    confidence: float = 0.95
    seed: int = 0


@dataclass
class Window:
    """Served α over consecutive records: their count, the time span, the percentile
    bootstrap interval (records resampled), and the same per serving draft version."""

    records: int
    start: float | None
    end: float | None
    alpha: float | None
    interval: list[float | None]
    by_version: dict = field(default_factory=dict)


@dataclass
class Change:
    """`after` − `before` α, with the interval of the difference (each window resampled on
    its own)."""

    delta: float | None
    interval: list[float | None]


@dataclass
class Recovery:
    """The first rolling window of phase-2 records whose served α is back within `fraction`
    of the pre-shift window's: its last record's index after the shift (records) and time
    after the shift's start (seconds), the version serving most of it, and how many refreshes
    came after the first post-shift promotion up to that version's promotion."""

    recovered: bool
    fraction: float
    threshold: float | None
    records: int | None = None
    seconds: float | None = None
    alpha: float | None = None
    version: str | None = None
    refreshes_after_first_promotion: int | None = None
    first_promotion: str | None = None
    start: float | None = None
    end: float | None = None


@dataclass
class ShiftFigures:
    """What the demo exists to show: the drop at the shift, the recovery, the old domain held."""

    window_records: int
    before_shift: Window
    after_shift: Window
    drop: Change  # before − after: positive when acceptance falls at the shift
    recovery: Recovery
    after_return: Window
    original_domain_change: Change  # after the return − before the shift

    def as_dict(self) -> dict:
        return asdict(self)


def _counts(records) -> np.ndarray:
    """[n, 3] (spec steps, drafted, accepted) of the records with speculative counters."""
    rows = [
        (s["num_spec_steps"], s["num_draft_tokens"], s["num_accepted_draft_tokens"])
        for s in (r.get("speculative") for r in records)
        if s and s["num_spec_steps"]
    ]
    return np.asarray(rows, dtype=np.float64).reshape(-1, 3)


def _alpha_of_sums(sums: np.ndarray) -> float:
    steps, drafted, accepted = sums
    return alpha_from_counts(steps, drafted, accepted) if steps and drafted else np.nan


def _resampled(counts: np.ndarray, boot: Bootstrap, salt: int) -> np.ndarray:
    """α of each bootstrap resample of `counts`' records (NaN for an empty window)."""
    if not len(counts):
        return np.full(boot.samples, np.nan)
    idx = bootstrap_indices(len(counts), boot.samples, boot.seed + salt)
    return np.array([_alpha_of_sums(s) for s in counts[idx].sum(axis=1)])


def _interval(values, confidence: float) -> list[float | None]:
    return [None if np.isnan(v) else v for v in percentile_interval(values, confidence)]


def window(records, boot: Bootstrap, salt: int = 0) -> Window:
    records = list(records)
    counts = _counts(records)
    versions: dict[str, list] = {}
    for r in records:
        versions.setdefault(r.get("draft_version") or "none", []).append(r)
    by_version = {}
    for k, (v, rs) in enumerate(sorted(versions.items())):
        c = _counts(rs)
        by_version[v] = {
            "records": len(rs),
            "alpha": served_alpha(rs),
            "interval": _interval(_resampled(c, boot, salt + 7 * (k + 1)), boot.confidence),
        }
    times = [r["time"] for r in records]
    return Window(
        records=len(records),
        start=min(times) if times else None,
        end=max(times) if times else None,
        alpha=served_alpha(records),
        interval=_interval(_resampled(counts, boot, salt), boot.confidence),
        by_version=by_version,
    )


def change(before, after, boot: Bootstrap, salt: int = 0) -> Change:
    """after − before, each window's records resampled independently."""
    a, b = _counts(before), _counts(after)
    if not len(a) or not len(b):
        return Change(None, [None, None])
    delta = _alpha_of_sums(b.sum(axis=0)) - _alpha_of_sums(a.sum(axis=0))
    diffs = _resampled(b, boot, salt + 1) - _resampled(a, boot, salt + 2)
    return Change(float(delta), _interval(diffs, boot.confidence))


def recovery(
    after, shift_start: float, threshold: float | None, size: int, promotions, decisions,
    fraction: float = 0.95,
) -> Recovery:  # fmt: skip
    """The first rolling window of `size` records of `after` (phase-2 records in completion
    order) with served α >= `threshold`. `promotions`: (time, version) promoted after the
    shift; `decisions`: the times of every refresh decision (promoted or not)."""
    out = Recovery(recovered=False, fraction=fraction, threshold=threshold)
    if threshold is None:
        return out
    if promotions:
        out.first_promotion = promotions[0][1]
    promoted_at = {v: t for t, v in promotions}
    for end in range(min(size, len(after)), len(after) + 1):
        chunk = after[max(0, end - size) : end]
        alpha = served_alpha(chunk)
        if alpha is None or alpha < threshold:
            continue
        counts: dict[str, int] = {}
        for r in chunk:
            counts[r.get("draft_version")] = counts.get(r.get("draft_version"), 0) + 1
        version = max(counts, key=lambda v: (counts[v], v or ""))
        out.recovered, out.records, out.alpha, out.version = True, end, alpha, version
        out.start, out.end = chunk[0]["time"], chunk[-1]["time"]
        out.seconds = chunk[-1]["time"] - shift_start
        if promotions:
            t_first = promotions[0][0]
            t_version = promoted_at.get(version)
            out.refreshes_after_first_promotion = (
                sum(1 for t in decisions if t_first < t <= t_version) if t_version else 0
            )
        return out
    return out


def shift_figures(
    records, starts: list[float], promotions, decisions, size: int, boot: Bootstrap,
    fraction: float = 0.95,
) -> ShiftFigures:  # fmt: skip
    """The windows of `size` records around the shift (`starts`: the three phases' start
    times): the last code records before it, the first prose records after it, the first
    code records after the return; a record counts in a phase by its completion time and its
    request's category (a request in flight at a phase change keeps its domain).
    `promotions`: (time, version) of every promotion; `decisions`: every refresh's time."""
    ordered = sorted(records, key=lambda r: r["time"])
    domain = {p: PHASES[p - 1] for p in (1, 2, 3)}
    by_phase = {
        p: [
            r
            for r in ordered
            if phase_of(r, starts) == p and r.get("category") in (None, domain[p])
        ]
        for p in (1, 2, 3)
    }
    before = by_phase[1][-size:]
    after = by_phase[2][:size]
    returned = by_phase[3][:size]
    w_before = window(before, boot, 0)
    threshold = None if w_before.alpha is None else fraction * w_before.alpha
    drop = change(after, before, boot, 10)  # before − after
    shift_start = starts[1] if len(starts) > 1 else float("inf")
    late = [(t, v) for t, v in promotions if t >= shift_start]
    return ShiftFigures(
        window_records=size,
        before_shift=w_before,
        after_shift=window(after, boot, 20),
        drop=drop,
        recovery=recovery(by_phase[2], shift_start, threshold, size, late, decisions, fraction),
        after_return=window(returned, boot, 30),
        original_domain_change=change(before, returned, boot, 40),
    )


# ------------------------------------------------------------------------------ plot
def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib  # lazy: matplotlib only for the plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: pyplot once the Agg backend is set

    return plt


def plot(path: Path, records, starts, promotions, window: int, figures=None) -> None:
    """Served α (rolling `window` requests) over minutes, the phase changes and promotions
    marked; with `figures` (ShiftFigures) the before / after / recovery / return windows
    shaded and their α drawn as levels."""
    plt = pyplot()

    records = sorted((r for r in records if r.get("speculative")), key=lambda r: r["time"])
    t0 = starts[0]
    xs, ys = [], []
    for i in range(len(records)):
        chunk = records[max(0, i - window + 1) : i + 1]
        xs.append((records[i]["time"] - t0) / 60)
        ys.append(served_alpha(chunk))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.plot(xs, ys, lw=1.2, label=f"served α (rolling {window} requests)")
    for i, s in enumerate(starts[1:], 2):
        ax.axvline((s - t0) / 60, color="k", ls="--", lw=1)
        ax.text((s - t0) / 60, 1.0, f" {PHASES[i - 1]}", va="top", fontsize=9)
    for j, (t, v) in enumerate(promotions):
        ax.axvline(
            (t - t0) / 60,
            color="tab:green",
            lw=0.8,
            alpha=0.7,
            label="promotion" if j == 0 else None,
        )
        ax.text((t - t0) / 60, 0.02, v, rotation=90, fontsize=7, color="tab:green")
    if figures is not None:
        _mark_windows(ax, figures, t0)
    ax.set_xlabel("minutes")
    ax.set_ylabel("accepted / drafted tokens")
    ax.set_ylim(0, 1.02)
    ax.set_title("specdistill online demo: served acceptance, code → prose → code")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mark_windows(ax, figures: ShiftFigures, t0: float) -> None:
    marks = [
        (figures.before_shift, "tab:blue", "before shift"),
        (figures.after_shift, "tab:red", "after shift"),
        (figures.recovery, "tab:purple", "recovered"),
        (figures.after_return, "tab:orange", "after return"),
    ]
    for w, color, name in marks:
        if w.start is None or w.alpha is None:
            continue
        a, b = (w.start - t0) / 60, (w.end - t0) / 60
        ax.axvspan(a, b, color=color, alpha=0.12)
        ax.hlines(w.alpha, a, b, color=color, lw=2.5, label=f"{name}: α {w.alpha:.3f}")
