"""What the online loop behind vLLM measured, read from vLLM's own counters (the scraper's
windows, online_demo/vllm_loop.py): served acceptance before the shift, after it, after the
first redeploy that follows it, and when the traffic returns to the first domain; and the
plot of served α over time with the phases and the redeploys marked.

Each figure pools the counters of its windows (rounds, draft tokens, accepted tokens), so a
busy window weighs more than a quiet one; α is `eval.stats.alpha_from_counts` over the pool.
A window belongs to the span its end falls in.
"""

from dataclasses import asdict, dataclass
from pathlib import Path

from specdistill.eval.served_metrics import ServedWindow
from specdistill.online_demo.report import pyplot


@dataclass
class Pooled:
    """Served acceptance over a span: windows, rounds, α, τ, per-position acceptance."""

    windows: int
    rounds: int
    alpha: float | None
    mean_accepted_length: float | None
    per_position: list[float]
    tokens_per_s: float | None


def pool(windows: list[dict]) -> Pooled:
    """The windows' counters summed into one `ServedWindow` (its seconds: the windows' own)."""
    width = max((len(w["accepted_per_position"]) for w in windows), default=0)
    per_pos = [0] * width
    for w in windows:
        for j, a in enumerate(w["accepted_per_position"]):
            per_pos[j] += a
    total = ServedWindow(
        start=0.0,
        end=sum(w["end"] - w["start"] for w in windows),
        drafts=sum(w["drafts"] for w in windows),
        draft_tokens=sum(w["draft_tokens"] for w in windows),
        accepted=sum(w["accepted"] for w in windows),
        generated=sum(w["generated"] for w in windows),
        accepted_per_position=per_pos,
    )
    return Pooled(
        windows=len(windows),
        rounds=total.drafts,
        alpha=total.alpha,
        mean_accepted_length=total.mean_accepted_length,
        per_position=total.per_position if total.drafts else [],
        tokens_per_s=total.tokens_per_s,
    )


def _between(windows: list[dict], start: float, end: float) -> list[dict]:
    return [w for w in windows if start < w["end"] <= end]


def shift_figures(windows: list[dict], starts: list[float], end: float, deployments: list) -> dict:
    """Served acceptance around the shift (`starts`: the three phases' starts; `end`: the
    load's end): before it (phase 1), after it until the first redeploy in phase 2, after
    that redeploy until phase 3, and on return (phase 3); with the recovery's ratio to the
    level before the shift and the return's change."""
    shift, back = starts[1], starts[2]
    switched = [d["switched"] for d in deployments if d["event"] == "deployed"]
    first = next((t for t in switched if shift < t < back), None)
    spans = {
        "before_shift": _between(windows, starts[0], shift),
        "after_shift": _between(windows, shift, first if first is not None else back),
        "after_redeploy": _between(windows, first, back) if first is not None else [],
        "on_return": _between(windows, back, end),
    }
    later = [t for t in switched if first is not None and first < t]
    spans["first_version_after_shift"] = (
        _between(windows, first, min(later + [back])) if first is not None else []
    )
    figures = {name: asdict(pool(ws)) for name, ws in spans.items()}
    before = figures["before_shift"]["alpha"]
    figures["recovery"] = recovery(windows, shift, back, switched, before)
    recovered = figures["after_redeploy"]["alpha"]
    returned = figures["on_return"]["alpha"]
    figures["first_redeploy_after_shift_s"] = None if first is None else first - shift
    figures["recovery_ratio"] = recovered / before if before and recovered is not None else None
    figures["return_change"] = returned - before if None not in (before, returned) else None
    figures["redeploys"] = len(switched)
    return figures


def recovery(windows, shift: float, back: float, switched, level, span: int = 3) -> dict:
    """When served α after the shift is back to 95% of `level` (the pre-shift α), pooled
    over `span` consecutive windows: seconds after the shift, and the redeploys by then."""
    shifted = _between(windows, shift, back)
    if level is None:
        return {"seconds": None, "redeploys": None}
    for i in range(span, len(shifted) + 1):
        alpha = pool(shifted[i - span : i]).alpha
        if alpha is not None and alpha >= 0.95 * level:
            t = shifted[i - 1]["end"]
            return {"seconds": t - shift, "redeploys": sum(shift < x <= t for x in switched)}
    return {"seconds": None, "redeploys": None}


def plot(path: Path, windows: list[dict], starts: list[float], deployments: list) -> None:
    """Served α and τ per scrape window over time; phase starts dashed, redeploys dotted."""
    plt = pyplot()

    t0 = starts[0] if starts else 0.0
    shown = [w for w in windows if w["alpha"] is not None]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot([w["end"] - t0 for w in shown], [w["alpha"] for w in shown], "o-", label="served α")
    for i, s in enumerate(starts):
        ax.axvline(s - t0, color="grey", ls="--")
        ax.text(s - t0, 1.01, f"phase {i + 1}", fontsize=8)
    for d in deployments:
        if d["event"] == "deployed":
            ax.axvline(d["switched"] - t0, color="green", ls=":")
            ax.text(d["switched"] - t0, 0.02, d["version"], fontsize=7, rotation=90)
    ax.set_xlabel("seconds since the load began")
    ax.set_ylabel("α (vLLM's counters)")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="lower right")
    ax.set_title("served acceptance behind vLLM (scraped /metrics)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
