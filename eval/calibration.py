"""Calibration of predicted probabilities (the acceptance head's) against realised outcomes.

`calibration(pred, label, mask)` bins the predictions into equal-width bins over [0, 1] and
reports, per bin, the mean prediction, the mean realised value and the count, and the
expected calibration error

    ECE = Σ_b (n_b / n) · |mean predicted_b − mean realised_b|.

Labels may be soft (the per-position acceptance α = Σ min(p, q), the head's training label)
or 0/1 (whether the engine accepted a proposed token); with soft labels a head that predicts
its label exactly has ECE 0. `reliability_diagram` draws the bins as a PNG.
"""

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

DEFAULT_BINS = 10


@dataclass(frozen=True)
class CalibrationBin:
    """Predictions in [lower, upper) (the last bin includes 1): their count, mean prediction
    and mean realised value (None when the bin is empty)."""

    lower: float
    upper: float
    count: int
    mean_predicted: float | None
    mean_realised: float | None


@dataclass(frozen=True)
class CalibrationReport:
    """ECE over `n` valid predictions (None when n = 0) and the per-bin statistics."""

    ece: float | None
    n: int
    bins: list[CalibrationBin]

    def to_dict(self) -> dict:
        """Plain JSON-ready values (for eval.json)."""
        return asdict(self)


def calibration(
    pred: Tensor, label: Tensor, mask: Tensor | None = None, *, bins: int = DEFAULT_BINS
) -> CalibrationReport:
    """ECE and reliability bins of predicted probabilities `pred` [...] against realised
    values `label` [...] (in [0, 1]) at the valid positions of `mask` [...] (None: all)."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    if pred.shape != label.shape:
        raise ValueError(f"pred {list(pred.shape)} and label {list(label.shape)} must agree")
    if mask is not None and mask.shape != pred.shape:
        raise ValueError(f"mask {list(mask.shape)} must have the shape of pred {list(pred.shape)}")
    pred, label = pred.detach().double().flatten(), label.detach().double().flatten()
    if mask is not None:
        keep = mask.detach().to(torch.bool).flatten()
        pred, label = pred[keep], label[keep]
    for name, values in (("pred", pred), ("label", label)):
        outside = ~((values >= 0) & (values <= 1))  # NaN counts as outside
        if outside.any():
            raise ValueError(
                f"calibration: {int(outside.sum())} {name} values outside [0, 1] "
                f"(first {float(values[outside][0])}); pass probabilities, not logits"
            )
    index = (pred * bins).long().clamp_max(bins - 1)
    count = torch.bincount(index, minlength=bins)
    sum_pred = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, pred)
    sum_label = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, label)
    n = int(count.sum())
    ece = float((sum_pred - sum_label).abs().sum() / n) if n else None
    rows = []
    for b in range(bins):
        c = int(count[b])
        rows.append(
            CalibrationBin(
                lower=b / bins,
                upper=(b + 1) / bins,
                count=c,
                mean_predicted=float(sum_pred[b] / c) if c else None,
                mean_realised=float(sum_label[b] / c) if c else None,
            )
        )
    return CalibrationReport(ece=ece, n=n, bins=rows)


def reliability_diagram(report: CalibrationReport, path, *, title: str | None = None) -> Path:
    """Write the reliability diagram of `report` as a PNG at `path`: mean realised against
    mean predicted per bin (bars at the bins, the diagonal for perfect calibration) over the
    share of predictions in each bin. Returns the path."""
    import matplotlib  # lazy: matplotlib only for the plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: pyplot once the Agg backend is set

    path = Path(path)
    width = [b.upper - b.lower for b in report.bins]
    left = [b.lower for b in report.bins]
    filled = [b for b in report.bins if b.count]
    fig, (ax, ax_count) = plt.subplots(
        2, 1, figsize=(5, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    ax.bar(
        [b.lower for b in filled],
        [b.mean_realised for b in filled],
        width=[b.upper - b.lower for b in filled],
        align="edge",
        edgecolor="black",
        alpha=0.7,
        label="mean realised",
    )
    ax.plot(
        [b.mean_predicted for b in filled],
        [b.mean_realised for b in filled],
        "o",
        color="black",
        label="(mean predicted, mean realised)",
    )
    ax.plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
    ece = "n/a" if report.ece is None else f"{report.ece:.4f}"
    ax.set(
        ylabel="realised acceptance",
        xlim=(0, 1),
        ylim=(0, 1),
        title=(title + "\n" if title else "") + f"ECE {ece} (n = {report.n})",
    )
    ax.legend(fontsize=7, loc="upper left")
    share = [b.count / report.n if report.n else 0.0 for b in report.bins]
    ax_count.bar(left, share, width=width, align="edge", edgecolor="black", color="gray")
    ax_count.set(xlabel="predicted acceptance", ylabel="share", xlim=(0, 1))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
