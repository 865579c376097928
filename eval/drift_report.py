"""The α drift report: its schema (`DriftReport`, report.json), report.md, the plot and the
after-target's responses as training records (eval/drift.py measures; the meanings of the
numbers: eval/drift_cli.py's module docstring).
"""

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from specdistill.eval.prompts import prompt_text

# ----------------------------------------------------------------------------- schema


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AlphaInterval(_Strict):
    """α before / after / drop with their paired bootstrap intervals."""

    before: float
    after: float
    drop: float
    before_ci: list[float]
    after_ci: list[float]
    drop_ci: list[float]


class CategoryCell(_Strict):
    """One category's α (serving temperature, and `greedy` at T = 0), or only `n`,
    `insufficient` and `min_samples` when it has too few prompts."""

    n: int
    before: float | None = None
    after: float | None = None
    drop: float | None = None
    before_ci: list[float] | None = None
    after_ci: list[float] | None = None
    drop_ci: list[float] | None = None
    insufficient: bool
    min_samples: int | None = None
    greedy: AlphaInterval | None = None


class Verdict(_Strict):
    refit_recommended: bool
    threshold: float
    drop: float
    drop_ci: list[float]
    reason: str


class PerDepth(_Strict):
    """An EAGLE-3 head's α per drafting depth."""

    alpha_before: list[float]
    alpha_after: list[float]
    alpha_greedy_before: list[float]
    alpha_greedy_after: list[float]


class TopToken(_Strict):
    token_id: int
    token: str
    alpha_mass_lost: float
    count: int
    mean_alpha_drop: float


class DriftMeta(_Strict):
    """What the `drift` command line measured."""

    draft: str
    target_before: str
    target_after: str
    prompts: str
    max_new_tokens: int
    device: str
    dtype: str


class DriftReport(_Strict):
    """report.json of `specdistill drift`: what `summarise` computes, plus the serving
    temperature and draft type (`measure`) and the run's `meta` (the command line).
    Optional parts are written only when present (`write_json`)."""

    alpha_before: float
    alpha_after: float
    alpha_drop: float
    alpha_before_ci: list[float]
    alpha_after_ci: list[float]
    alpha_drop_ci: list[float]
    alpha_greedy_before: float
    alpha_greedy_after: float
    alpha_greedy_drop: float
    alpha_greedy_drop_ci: list[float]
    alpha_greedy_before_ci: list[float]
    alpha_greedy_after_ci: list[float]
    alpha_before_on_after_text: float
    alpha_greedy_before_on_after_text: float
    target_tv: float
    target_argmax_disagreement: float
    tau_before: dict[int, float]
    tau_after: dict[int, float]
    tau_greedy_before: dict[int, float]
    tau_greedy_after: dict[int, float]
    per_category: dict[str, CategoryCell]
    n_prompts: int
    n_positions_before: int
    n_positions_after: int
    verdict: Verdict
    drop_from_text: float
    drop_from_target: float
    per_depth: PerDepth | None = None
    top_tokens: list[TopToken] | None = None
    temperature: float | None = None
    draft_type: str | None = None
    meta: DriftMeta | None = None

    def write_json(self, path) -> None:
        """report.json: the fields that were given, in this order."""
        data = self.model_dump(exclude_unset=True)
        Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")

    @classmethod
    def read(cls, path) -> "DriftReport":
        return cls.model_validate(json.loads(Path(path).read_text()))


# ----------------------------------------------------------------------------- responses


def response_records(prompts, responses: list[list[int]], tokenizer) -> list[dict]:
    """Training records (data/records.py) of prompts and a target's responses: chat records
    ({"messages": [user, assistant]}) when the prompt is a chat and the tokenizer has a chat
    template (only the response is then a loss token), else {"text": prompt + response}."""
    records = []
    for prompt, ids in zip(prompts, responses, strict=True):
        eos = tokenizer.eos_token_id
        body = tokenizer.decode([t for t in ids if t != eos])
        if prompt.messages is not None and tokenizer.chat_template:
            records.append({"messages": [*prompt.messages, {"role": "assistant", "content": body}]})
        else:
            records.append({"text": prompt_text(prompt, tokenizer) + body})
        if prompt.category is not None:
            records[-1]["category"] = prompt.category
    return records


def save_responses(path, prompts, responses: list[list[int]], tokenizer) -> Path:
    """Write `response_records` as JSONL at `path` (usable as a recipe's data.train)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in response_records(prompts, responses, tokenizer):
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


# ----------------------------------------------------------------------------- output


def _fmt(x, digits=4) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _ci(ci) -> str:
    return f"[{_fmt(ci[0])}, {_fmt(ci[1])}]"


def markdown(report: dict) -> str:
    r = report
    verdict = "REFIT RECOMMENDED" if r["verdict"]["refit_recommended"] else "no refit needed"
    lines = [
        "# α drift report",
        "",
        f"Draft: `{r.get('meta', {}).get('draft', '?')}` ({r.get('draft_type', '?')}); "
        f"before: `{r.get('meta', {}).get('target_before', '?')}`; "
        f"after: `{r.get('meta', {}).get('target_after', '?')}`. "
        f"{r['n_prompts']} prompts, serving temperature {r.get('temperature')}.",
        "",
        "| | before | after | drop (95% CI) |",
        "|---|---|---|---|",
        f"| α (T={r.get('temperature')}) | {_fmt(r['alpha_before'])} | {_fmt(r['alpha_after'])} "
        f"| {_fmt(r['alpha_drop'])} {_ci(r['alpha_drop_ci'])} |",
        f"| α (T=0) | {_fmt(r['alpha_greedy_before'])} | {_fmt(r['alpha_greedy_after'])} "
        f"| {_fmt(r['alpha_greedy_drop'])} {_ci(r['alpha_greedy_drop_ci'])} |",
        "",
        f"- α of the draft vs the *before*-target on the after-target's text: "
        f"{_fmt(r['alpha_before_on_after_text'])} (drop from the text moving: "
        f"{_fmt(r['drop_from_text'])}; from the target's distribution moving: "
        f"{_fmt(r['drop_from_target'])})",
        f"- TV between the targets on the after-target's text: {_fmt(r['target_tv'])}; "
        f"argmax disagreement {_fmt(r['target_argmax_disagreement'])}",
        f"- **Verdict**: {verdict} ({r['verdict']['reason']})",
        "",
        "## Predicted τ per γ",
        "",
        "| γ | τ before | τ after | τ before (T=0) | τ after (T=0) |",
        "|---|---|---|---|---|",
    ]
    for g in r["tau_before"]:
        lines.append(
            f"| {g} | {_fmt(r['tau_before'][g], 3)} | {_fmt(r['tau_after'].get(g), 3)} | "
            f"{_fmt(r['tau_greedy_before'].get(g), 3)} | {_fmt(r['tau_greedy_after'].get(g), 3)} |"
        )
    lines += [
        "",
        "## Per category",
        "",
        "| category | n | α before | α after | drop (95% CI) |",
        "|---|---|---|---|---|",
    ]
    for name, cell in r["per_category"].items():
        if cell["insufficient"]:
            lines.append(f"| {name} | {cell['n']} | insufficient (< {cell['min_samples']}) | | |")
        else:
            lines.append(
                f"| {name} | {cell['n']} | {_fmt(cell['before'])} | {_fmt(cell['after'])} | "
                f"{_fmt(cell['drop'])} {_ci(cell['drop_ci'])} |"
            )
    if "per_depth" in r:
        d = r["per_depth"]
        lines += [
            "",
            "## Per draft position (EAGLE-3, chained)",
            "",
            "| depth | α before | α after | α before (T=0) | α after (T=0) |",
            "|---|---|---|---|---|",
        ]
        for i in range(len(d["alpha_before"])):
            lines.append(
                f"| {i + 1} | {_fmt(d['alpha_before'][i])} | {_fmt(d['alpha_after'][i])} | "
                f"{_fmt(d['alpha_greedy_before'][i])} | {_fmt(d['alpha_greedy_after'][i])} |"
            )
    if r.get("top_tokens"):
        lines += [
            "",
            "## Tokens losing the most acceptance mass (after-target's argmax)",
            "",
            "| token | count | share of α lost | mean α drop |",
            "|---|---|---|---|",
        ]
        for t in r["top_tokens"]:
            lines.append(
                f"| {json.dumps(t['token'])} | {t['count']} | {_fmt(t['alpha_mass_lost'])} | "
                f"{_fmt(t['mean_alpha_drop'])} |"
            )
    return "\n".join(lines) + "\n"


def plot(report: dict, path) -> Path | None:
    """Per-category α before / after with intervals, and τ per γ (or α per depth)."""
    try:
        import matplotlib  # lazy: matplotlib only for the plots

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: pyplot once the Agg backend is set
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    cells = {
        "all": {
            "before": report["alpha_before"],
            "after": report["alpha_after"],
            "before_ci": report["alpha_before_ci"],
            "after_ci": report["alpha_after_ci"],
        }
    }
    cells.update({k: v for k, v in report["per_category"].items() if not v["insufficient"]})
    names = list(cells)
    x = np.arange(len(names))
    for offset, side, color in ((-0.2, "before", "tab:blue"), (0.2, "after", "tab:red")):
        values = [cells[n][side] for n in names]
        err = np.array(
            [
                [v - cells[n][f"{side}_ci"][0], cells[n][f"{side}_ci"][1] - v]
                for n, v in zip(names, values, strict=True)
            ]
        ).T
        axes[0].bar(x + offset, values, 0.4, yerr=err, color=color, label=side, capsize=3)
    axes[0].set_xticks(x, names, rotation=30, ha="right")
    axes[0].set_ylabel(f"α (T={report.get('temperature')})")
    axes[0].set_title("acceptance per category (95% CI)")
    axes[0].legend()
    if "per_depth" in report:
        d = report["per_depth"]
        depths = np.arange(1, len(d["alpha_before"]) + 1)
        axes[1].plot(depths, d["alpha_before"], "o-", label="before")
        axes[1].plot(depths, d["alpha_after"], "o-", label="after")
        axes[1].set_xlabel("draft position")
        axes[1].set_ylabel("α")
        axes[1].set_title("α per draft position")
    else:
        gammas = list(report["tau_before"])
        axes[1].plot(gammas, list(report["tau_before"].values()), "o-", label="before")
        axes[1].plot(gammas, list(report["tau_after"].values()), "o-", label="after")
        axes[1].set_xlabel("γ")
        axes[1].set_ylabel("predicted τ")
        axes[1].set_title("predicted tokens per round")
    axes[1].legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(report: dict[str, Any], out, prompts=None, responses=None, tokenizer=None) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    DriftReport.model_validate(report).write_json(out / "report.json")
    (out / "report.md").write_text(markdown(report))
    plot(report, out / "drift.png")
    if responses is not None:
        save_responses(out / "responses_after.jsonl", prompts, responses["after"], tokenizer)
