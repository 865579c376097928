"""Why the acceptance losses' margin over forward KL shrinks: diagnostics of trained drafts.

    python -m benchmarks.margin_study runs/study/code          # a loss_compare --out folder
    python -m benchmarks.margin_study runs/study/code --plot docs/img/quality_code.png

For every run folder `<label>-seed<N>/` that `benchmarks/loss_compare.py` wrote, reads the
held-out α curve (metrics.jsonl; run loss_compare with `eval.every=50` to have one) and
loads its final draft against the target to split what it still loses on held-out text.

At one position the draft loses 1 − α = Σ_x (p(x) − q(x))⁺ (docs/theory.md §1). TV's
gradient on the draft's logit of x is proportional to q(x) (∂q(x)/∂z_x = q(x)(1 − q(x))),
so a token the target likes and the draft almost never proposes gets almost no push:
that part of the gap is *starved*. We count it as the mass (p − q)⁺ on tokens with
q(x) < p(x)/10. forward KL's gradient on the same logit is q(x) − p(x), not small there.
If TV's final draft leaves more of its gap starved than fkl's, a little fkl in the mix
(`loss.name: mix`) should recover it; if the gaps are alike and the curves flat, the draft
is out of capacity and no divergence will move it much.

Prints, per label (mean over seeds): α at each evaluated step (the curve), the final α,
the gap and its starved share, α on the third of positions where the target is most and
least certain (entropy of p), and writes `margin_study.json` into the folder.
"""

import argparse
import json
import re
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from specdistill.train.config import load_recipe
from specdistill.train.trainer import Trainer

STARVED_RATIO = 0.1  # q(x) < p(x) / 10: TV's push on x is at most a tenth of fkl's


def curve(run: Path) -> dict[int, float]:
    """{step: held-out α} from the run's periodic evaluations."""
    points = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "eval/alpha" in record:
            points[record["step"]] = record["eval/alpha"]
    return points


@torch.no_grad()
def gap_split(run: Path, max_sequences: int) -> dict:
    """α, gap, starved share and α by target-entropy third for the run's final draft."""
    with tempfile.TemporaryDirectory() as tmp:
        recipe = load_recipe(
            str(run / "recipe.yaml"),
            [
                f"draft.model={run / 'final'}",
                "data.on_policy.fraction=0",
                f"eval.max_sequences={max_sequences}",
                f"train.output_dir={tmp}",
                "train.resume='no'",
                "train.overwrite=true",
            ],
        )
        trainer = Trainer.from_recipe(recipe)
        temperature = recipe.eval.temperature
        alpha, starved, entropy = [], [], []
        for batch in trainer.eval_batches():
            drafts, targets, masks = trainer.kind.depths(trainer.draft, trainer.target, batch)
            d, t, mask = drafts[0], targets[0], masks[0]
            p = torch.softmax(t[mask].float() / temperature, -1)
            q = torch.softmax(d[mask].float() / temperature, -1)
            loss = (p - q).clamp_min(0)
            alpha.append(1 - loss.sum(-1))
            starved.append((loss * (q < STARVED_RATIO * p)).sum(-1))
            entropy.append(-(p * p.clamp_min(1e-30).log()).sum(-1))
    alpha, starved, entropy = torch.cat(alpha), torch.cat(starved), torch.cat(entropy)
    order = entropy.argsort()
    third = len(order) // 3
    return {
        "alpha": alpha.mean().item(),
        "gap": (1 - alpha).mean().item(),
        "starved": starved.mean().item(),
        "starved_share": (starved.sum() / (1 - alpha).sum()).item(),
        "alpha_certain_third": alpha[order[:third]].mean().item(),
        "alpha_uncertain_third": alpha[order[-third:]].mean().item(),
        "positions": len(alpha),
    }


def mean(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path, help="a benchmarks/loss_compare.py --out folder")
    parser.add_argument("--max-sequences", type=int, default=64)
    parser.add_argument("--plot", type=Path, default=None, help="α against steps, per label")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    runs = defaultdict(list)
    for run in sorted(args.folder.iterdir()):
        match = re.fullmatch(r"(.+)-seed(\d+)", run.name)
        if match and (run / "final").is_dir():
            runs[match.group(1)].append(run)
    if not runs:
        raise SystemExit(f"{args.folder}: no finished <label>-seed<N>/ runs with a final/ draft")
    report = {}
    for label, folders in runs.items():
        curves = [curve(r) for r in folders]
        splits = [gap_split(r, args.max_sequences) for r in folders]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        report[label] = {
            "seeds": [r.name for r in folders],
            "curve": {s: statistics.mean(c[s] for c in curves) for s in steps},
            **{k: [s[k] for s in splits] for k in splits[0]},
        }
    print(f"\n{args.folder}: held-out α at T=1 against steps (mean over seeds)")
    steps = sorted({s for row in report.values() for s in row["curve"]})
    print(f"{'run':<14}" + "".join(f"{s:>8}" for s in steps))
    for label, row in report.items():
        print(f"{label:<14}" + "".join(f"{row['curve'].get(s, float('nan')):>8.4f}" for s in steps))
    print("\nWhat the final drafts lose (mean ± std over seeds):")
    keys = ("alpha", "starved_share", "alpha_certain_third", "alpha_uncertain_third")
    print(f"{'run':<14}" + "".join(f"{k:>24}" for k in keys))
    for label, row in report.items():
        print(f"{label:<14}" + "".join(f"{mean(row[k]):>24}" for k in keys))
    (args.folder / "margin_study.json").write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(report, args.plot, args.title or str(args.folder))
    return report


def plot(report: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    bases = sorted({label.removesuffix("+op") for label in report})
    colours = {base: f"C{i}" for i, base in enumerate(bases)}
    for label, row in sorted(report.items()):
        curve = {int(s): a for s, a in row["curve"].items()}  # str keys when read from JSON
        steps = sorted(curve)
        style = "--" if label.endswith("+op") else "-"
        colour = colours[label.removesuffix("+op")]
        alphas = [curve[s] for s in steps]
        ax.plot(steps, alphas, style, color=colour, marker="o", ms=3, label=label)
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("held-out α at T=1 (mean over seeds)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
