"""The online demo's results: served α over the traffic records, their phases, the plot."""

from pathlib import Path

from specdistill.eval.stats import alpha_from_counts
from specdistill.train.online.loadgen import PHASES


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


def plot(path: Path, records, starts, promotions, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    ax.set_xlabel("minutes")
    ax.set_ylabel("accepted / drafted tokens")
    ax.set_ylim(0, 1.02)
    ax.set_title("specdistill online demo: served acceptance, code → prose → code")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
