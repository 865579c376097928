"""The speculative-decoding report's PNG plots (eval/report.py writes them beside report.md).

Every series keeps one look across the plots: its colour says the draft length (each γ,
"auto", "adaptive" a colour of its own; the target alone black), its line style (or, for
bars, its hatching) the temperature. So "T=0 γ=1" and "T=1 γ=5" never share a look, however
many configurations a sweep has. The τ / speedup plot has γ on its x axis: there colour says
the quantity (measured, predicted, ideal) and line style the temperature.
"""

import math
from pathlib import Path

LINE_STYLES = ["-", "--", ":", "-."]
HATCHES = ["", "//", "..", "xx"]
TARGET_COLOUR = "black"


def gamma_order(configs: list[dict]) -> list:
    """The configurations' γ labels: integers ascending, then "auto", then "adaptive"."""
    labels = {e["gamma"] for e in configs}
    ints = sorted(g for g in labels if isinstance(g, int))
    return ints + [g for g in ("auto", "adaptive") if g in labels]


class Styles:
    """Colour per γ label, line style and hatching per temperature (module docstring)."""

    def __init__(self, result: dict):
        import matplotlib  # lazy: matplotlib only for the plots

        gammas = gamma_order(result["configs"])
        cmap = matplotlib.colormaps["tab10" if len(gammas) <= 10 else "turbo"]
        n = max(1, len(gammas) - 1)
        self.colours = {
            g: cmap(i) if len(gammas) <= 10 else cmap(i / n) for i, g in enumerate(gammas)
        }
        self.temperatures = list(result["baselines"])  # f"{T:g}", in the sweep's order

    def _t(self, temperature) -> int:
        key = temperature if isinstance(temperature, str) else f"{temperature:g}"
        return self.temperatures.index(key) if key in self.temperatures else 0

    def line(self, temperature, gamma) -> dict:
        """matplotlib line keywords for a series; gamma None: the target alone."""
        colour = TARGET_COLOUR if gamma is None else self.colours[gamma]
        return {"color": colour, "ls": LINE_STYLES[self._t(temperature) % len(LINE_STYLES)]}

    def bar(self, temperature, gamma) -> dict:
        return {
            "color": self.colours[gamma],
            "hatch": HATCHES[self._t(temperature) % len(HATCHES)],
            "edgecolor": "white",
        }

    def series_of(self, result: dict) -> dict[str, tuple[str, object]]:
        """Run name -> (temperature, γ label or None for the target alone)."""
        found = {b["name"]: (t, None) for t, b in result["baselines"].items()}
        for e in result["configs"]:
            found[e["name"]] = (f"{e['temperature']:g}", e["gamma"])
        return found


def write_plots(result: dict, token_latencies: dict[str, list[float]], out: Path) -> None:
    """acceptance_per_position.png, tau_speedup_vs_gamma.png, rejection_positions.png and
    latency_cdf.png into `out`."""
    import matplotlib  # lazy: matplotlib only for the plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: pyplot once the Agg backend is set

    styles = Styles(result)
    configs = result["configs"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for e in configs:
        slots = e["slot_acceptance"]
        ax.plot(
            range(1, len(slots) + 1),
            slots,
            marker="o",
            label=e["name"],
            **styles.line(e["temperature"], e["gamma"]),
        )
    ax.set(xlabel="draft slot i", ylabel="P(accept slot i | slots < i accepted)", ylim=(0, 1.02))
    ax.legend(fontsize=7)
    _save(fig, out / "acceptance_per_position.png")

    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(10, 4))
    for t in result["baselines"]:
        fixed = sorted(
            (e for e in configs if f"{e['temperature']:g}" == t and isinstance(e["gamma"], int)),
            key=lambda e: e["gamma"],
        )
        gs = [e["gamma"] for e in fixed]
        ls = styles.line(t, None)["ls"]
        for ax, key, colour, marker, what in (
            (ax_tau, "tau", "C0", "o", "measured"),
            (ax_tau, "tau_pred", "C1", "x", "predicted (iid α)"),
            (ax_tau, "tau_pred_rounds", "C2", "+", "predicted (rounds)"),
            (ax_speed, "speedup", "C0", "o", "measured"),
            (ax_speed, "ideal_speedup", "C3", "x", "ideal"),
        ):
            values = [e.get(key, math.nan) for e in fixed]
            ax.plot(gs, values, ls=ls, color=colour, marker=marker, label=f"T={t} {what}")
    gammas = sorted({e["gamma"] for e in configs if isinstance(e["gamma"], int)})
    ax_tau.set(xlabel="γ", ylabel="τ (tokens per round)", xticks=gammas)
    ax_speed.set(xlabel="γ", ylabel="speedup over target-only", xticks=gammas)
    ax_speed.axhline(1.0, color="grey", lw=0.8)
    ax_tau.legend(fontsize=7)
    ax_speed.legend(fontsize=7)
    _save(fig, out / "tau_speedup_vs_gamma.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(configs)
    longest = max(len(e["rejection_histogram"]) for e in configs)
    for k, e in enumerate(configs):
        total = sum(e["rejection_histogram"]) + e["no_rejection"]
        padded = e["rejection_histogram"] + [0] * (longest - len(e["rejection_histogram"]))
        hist = [n / total if total else 0.0 for n in [*padded, e["no_rejection"]]]
        ax.bar(
            [i + k * width for i in range(len(hist))],
            hist,
            width=width,
            label=e["name"],
            **styles.bar(e["temperature"], e["gamma"]),
        )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(longest + 1)])
    ax.set_xticklabels([str(i + 1) for i in range(longest)] + ["none"])
    ax.set(xlabel="slot of the first rejection", ylabel="fraction of rounds")
    ax.legend(fontsize=7)
    _save(fig, out / "rejection_positions.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    series = styles.series_of(result)
    for name, lat in token_latencies.items():
        xs = sorted(1e3 * v for v in lat)
        look = styles.line(*series[name]) if name in series else {}
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=name, **look)
    ax.set(xlabel="per-token latency (ms)", ylabel="CDF", xscale="log")
    ax.legend(fontsize=7)
    _save(fig, out / "latency_cdf.png")


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt  # lazy: pyplot, loaded with the Agg backend by write_plots

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
