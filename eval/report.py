"""The speculative-decoding report: report.json, report.md, outputs.jsonl and PNG plots.

Written by `python eval/speculative.py ...` (see its docstring) from the result of one
evaluation sweep (eval/sweep.py: per temperature a target-only baseline, then each γ and
adaptive γ). `summary_table` is report.md's table of every configuration. Plots:
eval/report_plots.py; the one screen the CLI prints instead of the table:
eval/report_console.py.
"""

import json
import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from specdistill.eval.engine import Generation
from specdistill.eval.lossless import GreedyCheck, markdown_lines
from specdistill.eval.prompts import Prompt, prompt_text
from specdistill.eval.report_plots import write_plots
from specdistill.eval.sweep import Settings
from specdistill.eval.vllm_compare import VllmEntry
from specdistill.eval.vllm_compare import markdown_lines as vllm_lines

# ----------------------------------------------------------------------------- report.json

Number = int | float  # kept as given (an int stays an int in report.json)
Metric = int | float | None  # None: no data (NaN in memory, null in report.json)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Percentiles(_Strict):
    p50: Metric
    p95: Metric
    p99: Metric
    mean: Metric


class DecodeStats(_Strict):
    """One run's decoding measurements (eval/sweep.py `_decode_stats`)."""

    tokens: int
    wall_s: Number
    tokens_per_s: Number
    requests_per_s: Number
    ttft_s: Percentiles
    token_latency_s: Percentiles
    request_latency_s: Percentiles
    queue_s: Percentiles
    rounds: int
    verify_s_per_round: Metric
    prefill_s: Number


class _Named(_Strict):
    name: str


class Baseline(DecodeStats, _Named):
    """The target-only run at one temperature: `name`, then its `DecodeStats`."""


class CostEntry(_Strict):
    """The cost model at one batch size (eval/cost_model.py): seconds."""

    draft_s: Metric
    verify_s: list[Metric]


class _ConfigFields(_Strict):
    name: str
    temperature: Number
    gamma: int | Literal["adaptive", "auto"]
    tau: Metric
    tau_interval: list[Metric] | None = None  # 95% over prompts (eval/stats.py tau_interval)
    tau_pred: Metric
    tau_pred_pathwise: Metric
    tau_pred_rounds: Metric
    tau_pred_rounds_error: Metric
    tau_pred_iid_error: Metric
    tau_gap: Metric
    tau_within_tolerance: bool
    alpha_offline: Metric
    alpha_offline_depth: list[Metric] | None
    alpha_measured: Metric
    acceptance_rate: Metric
    slot_acceptance: list[Metric]
    rejection_histogram: list[int]
    no_rejection: int
    mean_gamma: Metric
    draft_time_share: Metric
    draft_s: Number
    verify_s: Number
    cost_ratio_c: Metric
    verify_cost_ratio: Metric
    speedup: Metric
    ideal_speedup: Metric
    engine_efficiency: Metric
    best_gamma_predicted: int | None
    target_tokens_per_s: Number
    greedy_identical: int | None = None  # T=0: prompts whose output is the target-only one's
    greedy_check: GreedyCheck | None = None  # T=0: its divergences, near-ties or real errors
    # γ = "auto" only (eval/sweep.py `_length_stats`):
    drafted_length_histogram: list[int] | None = None
    mean_drafted_length: Metric = None
    mean_predicted_acceptance: Metric = None
    mean_realised_acceptance: Metric = None
    cost_model: dict[str, CostEntry] | None = None


class ConfigEntry(DecodeStats, _ConfigFields):
    """One (temperature, γ) configuration: its speculative measurements and predictions
    (eval/sweep.py `_config`), then its `DecodeStats`."""


class BestGamma(_Strict):
    measured: int
    speedup: Metric
    predicted: int | None
    predicted_rounds: int | None


class SpeculateMeta(_Strict):
    """What the `speculate` command line ran."""

    target: str
    target_adapter: str | None
    draft: str
    prompts: str
    n_prompts: int
    device: str
    dtype: str
    threads: int
    cores: int | None = None  # the cores the run could use
    # The highest 1-minute load average seen while the machine counted as busy (more
    # processes wanting a core than cores, specdistill/progress.py); None: never busy.
    busy_load_average: Number | None = None


class SpeculateReport(_Strict):
    """report.json of `specdistill speculate`: the sweep's result (eval/sweep.py `sweep`:
    temperatures as f"{T:g}") and the run's `meta`. NaN metrics are written as null."""

    settings: Settings
    tau_tolerance: Number
    baselines: dict[str, Baseline]
    configs: list[ConfigEntry]
    best_gamma: dict[str, BestGamma]
    meta: SpeculateMeta | None = None
    vllm: list[VllmEntry] | None = None  # --engine vllm: vLLM beside this engine

    @classmethod
    def of(cls, result: dict) -> "SpeculateReport":
        """The report of a sweep's result dict (NaN -> None)."""
        return cls.model_validate(_json_safe(result))

    def to_json(self) -> str:
        return json.dumps(self.model_dump(exclude_unset=True), indent=2, allow_nan=False)

    @classmethod
    def read(cls, path) -> "SpeculateReport":
        return cls.model_validate_json(Path(path).read_text())


def _fmt(x, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _interval(bounds) -> str:
    """The interval as "lower – upper", or "–" when there is none (fewer than 2 prompts)."""
    if not bounds or any(math.isnan(x) for x in bounds):
        return "–"
    return " – ".join(_fmt(x) for x in bounds)


def _off(value) -> str:
    """A sampling filter's setting; None is off."""
    return "off" if value is None else str(value)


def _pct(x) -> str:
    """A relative error as a signed percentage."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{100 * x:+.1f}%"


def _ms(stats: dict, digits: int = 1) -> str:
    return "/".join(_fmt(1e3 * stats[k], digits) for k in ("p50", "p95", "p99"))


COLUMNS = [
    ("config", lambda e: e["name"]),
    ("τ", lambda e: _fmt(e["tau"])),
    ("τ 95% CI", lambda e: _interval(e.get("tau_interval"))),
    ("τ pred (iid α)", lambda e: _fmt(e["tau_pred"])),
    ("iid err", lambda e: _pct(e.get("tau_pred_iid_error"))),
    ("τ pred (rounds)", lambda e: _fmt(e.get("tau_pred_rounds"))),
    ("rounds err", lambda e: _pct(e.get("tau_pred_rounds_error"))),
    ("τ pred (pathwise α)", lambda e: _fmt(e["tau_pred_pathwise"])),
    ("α offline", lambda e: _fmt(e["alpha_offline"], 3)),
    ("draft share", lambda e: _fmt(e["draft_time_share"])),
    ("verify ms/round", lambda e: _fmt(1e3 * e["verify_s_per_round"])),
    ("c", lambda e: _fmt(e["cost_ratio_c"])),
    ("v", lambda e: _fmt(e["verify_cost_ratio"])),
    ("tok/s", lambda e: _fmt(e["tokens_per_s"], 1)),
    ("target tok/s", lambda e: _fmt(e["target_tokens_per_s"], 1)),
    ("speedup", lambda e: _fmt(e["speedup"])),
    ("ideal", lambda e: _fmt(e["ideal_speedup"])),
    ("efficiency", lambda e: _fmt(e["engine_efficiency"])),
    ("TTFT P50/P95/P99 ms", lambda e: _ms(e["ttft_s"])),
    ("per-token P50/P95/P99 ms", lambda e: _ms(e["token_latency_s"], 2)),
]

DEFINITIONS = (
    "τ counts tokens committed per row per round (accepted drafts + the bonus or correction "
    "token), over rounds whose γ was not shortened by the length limit; its 95% CI is a "
    "percentile bootstrap over prompts, each prompt's rounds resampled together. τ pred (iid α) = "
    "(1 − α^(γ+1))/(1 − α) with α the offline acceptance Σ min(p, q) (argmax agreement at T=0), "
    "teacher-forced on the same prompts and generated outputs. τ pred (rounds) replays the "
    "rounds along the same text with their real boundaries (each round starts where the last "
    "one ended, `stats.tau_rounds`): the prediction training reports as tau_pred. err = "
    "(prediction − τ)/τ. τ pred (pathwise α) keeps the "
    "offline α of each generated position and the real round starts s: 1 + Σ_j Π_{i≤j} α_{s+i−1}. "
    "speedup = tok/s ÷ target-only tok/s; ideal = τ/(γc + 1) (Leviathan et al. Thm 3.8 at the α "
    "that gives the measured τ), c = draft time per drafted token ÷ target time per decoding step; "
    "efficiency = speedup ÷ ideal. v = verification pass ÷ target decoding step: the ideal "
    "assumes v = 1, so v > 1 (scoring γ + 1 tokens at once costs more than one) lowers the "
    "efficiency without any engine overhead. Requests all arrive at the start and share "
    "`batch size` rows (continuous batching); TTFT and per-request latency count from a "
    "request's admission into the batch, the wait before it is `queue_s` in report.json. "
    "Per-token latency is a round's time divided by the tokens that row got from it."
)

GAP_COMMON = (
    "Why the i.i.d. prediction misses: (1 − α^(γ+1))/(1 − α) assumes every slot of every "
    "round is accepted with the mean α, independently. Real rounds start where the previous "
    "one ended, and acceptance along a text is not uniform: easy positions (boilerplate, "
    "closing brackets, repeated identifiers) and hard ones come in runs."
)
GAP_BELOW = (
    " Here measured τ is below it: a round ends at a rejection and the next one starts at the "
    "position right after it, which tends to be hard too, so slot 1 is accepted less often "
    "than the mean α (the engine's per-slot acceptance rises with the slot: the rounds that "
    "got past slot 1 are in an easy run)."
)
GAP_ABOVE = (
    " Here measured τ is above it: runs of easy positions let whole rounds through more often "
    "than independent draws at the mean α would (τ is convex in α, so mixing easy and hard "
    "rounds raises the mean τ over the τ of the mean α, Jensen)."
)
GAP_FIX = (
    " τ pred (rounds) replays the rounds along the text with each position's own α and the "
    "round boundaries the rounds themselves produce; at T=0 it equals the measured τ exactly "
    "(α is then argmax agreement along the target's own greedy text; batch size 1, no EOS "
    "stop). At T>0 it remains an approximation: an accepted draft token is distributed as "
    "min(p, q)/α, not as the target sample on which the next position's α was measured."
)


def gap_explanation(off: list[dict]) -> str:
    """The explanation of the i.i.d. prediction's miss, its sign taken from the data
    (`tau_gap` = (measured − predicted)/predicted of the configurations outside tolerance)."""
    below = [e for e in off if e["tau_gap"] < 0]
    above = [e for e in off if e["tau_gap"] > 0]
    text = GAP_COMMON
    if below:
        text += GAP_BELOW
    if above:
        text += GAP_ABOVE if not below else GAP_ABOVE.replace("Here", "Where it is above,")
    return text + GAP_FIX


def summary_table(result: dict) -> str:
    rows = [
        "| " + " | ".join(name for name, _ in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for e in result["configs"]:
        rows.append("| " + " | ".join(cell(e) for _, cell in COLUMNS) + " |")
    return "\n".join(rows)


def _markdown(result: dict) -> str:
    lines = _heading_lines(result)
    lines += _best_gamma_lines(result["best_gamma"])
    lines += _length_lines(result["configs"])
    lines += _baseline_lines(result["baselines"])
    lines += _tau_lines(result)
    lines += _slot_lines(result["configs"])
    lines += markdown_lines(result["configs"])
    lines += vllm_lines(result.get("vllm") or [])
    lines += [
        "",
        "## Plots",
        "",
        "![per-position acceptance](acceptance_per_position.png)",
        "![tau and speedup vs gamma](tau_speedup_vs_gamma.png)",
        "![rejection positions](rejection_positions.png)",
        "![latency CDF](latency_cdf.png)",
        "",
    ]
    return "\n".join(lines)


def _heading_lines(result: dict) -> list[str]:
    """report.md's title, what was measured and how, the summary table and the definitions."""
    meta = result.get("meta", {})
    s = result["settings"]
    return [
        "# Speculative decoding report",
        "",
        f"target `{meta.get('target')}`, draft `{meta.get('draft')}`, "
        f"prompts `{meta.get('prompts')}` ({meta.get('n_prompts')}), "
        f"device {meta.get('device')} {meta.get('dtype')}; batch size {s['batch_size']}, "
        f"max new tokens {s['max_new_tokens']}, top-p {_off(s['top_p'])}, "
        f"top-k {_off(s['top_k'])}, "
        f"seed {s['seed']}; timings: the fastest of {s.get('repeats', 1)} run(s) of each "
        "configuration.",
        "",
        summary_table(result),
        "",
        DEFINITIONS,
        "",
    ]


def _best_gamma_lines(best_gamma: dict) -> list[str]:
    """report.md's best γ per temperature, measured and as the models predict it."""
    lines = [
        "## Best γ",
        "",
        "| temperature | best γ (measured tok/s) | speedup | best γ (model: α offline, c) "
        "| best swept γ (model: τ pred (rounds), c) |",
        "|---|---|---|---|---|",
    ]
    for t, b in best_gamma.items():
        lines.append(
            f"| {t} | {b['measured']} | {_fmt(b['speedup'])} | {_fmt(b['predicted'])} "
            f"| {_fmt(b.get('predicted_rounds'))} |"
        )
    return lines


def _baseline_lines(baselines: dict) -> list[str]:
    """report.md's target-only speed and latency per temperature."""
    lines = [
        "",
        "## Target-only baselines",
        "",
        "| temperature | tok/s | TTFT P50/P95/P99 ms | per-token P50/P95/P99 ms |",
        "|---|---|---|---|",
    ]
    for t, b in baselines.items():
        lines.append(
            f"| {t} | {_fmt(b['tokens_per_s'], 1)} | {_ms(b['ttft_s'])} "
            f"| {_ms(b['token_latency_s'], 2)} |"
        )
    return lines


def _tau_lines(result: dict) -> list[str]:
    """report.md's measured against predicted τ: the configurations outside the tolerance,
    the round-boundary prediction's errors, and why the i.i.d. prediction is off."""
    lines = ["", "## Measured vs predicted τ", ""]
    off = [e for e in result["configs"] if not e["tau_within_tolerance"]]
    verdict = (
        "Every configuration is within it."
        if not off
        else "Outside it: " + ", ".join(f"{e['name']} ({e['tau_gap']:+.1%})" for e in off) + "."
    )
    lines.append(f"Tolerance: |τ − τ pred| ≤ {result['tau_tolerance']:.0%} of τ pred. {verdict}")
    errors = [
        (e["name"], e["tau_pred_rounds_error"])
        for e in result["configs"]
        if e.get("tau_pred_rounds_error") is not None and not math.isnan(e["tau_pred_rounds_error"])
    ]
    if errors:
        name, worst = max(errors, key=lambda x: abs(x[1]))
        lines += [
            "",
            f"τ pred (rounds), the prediction training reports: largest error {worst:+.1%} "
            f"({name}); per configuration: "
            + ", ".join(f"{n} {err:+.1%}" for n, err in errors)
            + ".",
        ]
    if off:
        lines += ["", gap_explanation(off)]
    return lines


def _slot_lines(configs: list[dict]) -> list[str]:
    """report.md's per-slot acceptance and first-rejection positions of each configuration."""
    lines = ["", "## Per-slot conditional acceptance and rejection positions", ""]
    for e in configs:
        slots = ", ".join(_fmt(a) for a in e["slot_acceptance"])
        hist = ", ".join(f"{i + 1}: {n}" for i, n in enumerate(e["rejection_histogram"]))
        lines.append(
            f"- {e['name']}: acceptance by slot [{slots}]; first rejection at slot "
            f"{{{hist}}}, none: {e['no_rejection']}"
        )
    return lines


def _length_lines(configs: list[dict]) -> list[str]:
    """report.md's section on the per-row draft lengths of the "auto" configurations."""
    auto = [e for e in configs if e["gamma"] == "auto"]
    if not auto:
        return []
    lines = [
        "",
        "## Per-row draft lengths (γ = auto)",
        "",
        "| config | mean drafted | rounds per drafted length 0, 1, … | predicted acceptance (raw) "
        "| realised | c ms | v(0..) ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in auto:
        costs = e.get("cost_model") or {}
        first = costs[min(costs, key=int)] if costs else None
        c = "–" if first is None or first["draft_s"] is None else _fmt(1e3 * first["draft_s"])
        v = "–" if first is None else ", ".join(_fmt(1e3 * x, 1) for x in first["verify_s"])
        histogram = ", ".join(str(n) for n in e.get("drafted_length_histogram") or [])
        lines.append(
            f"| {e['name']} | {_fmt(e.get('mean_drafted_length'))} | {histogram} "
            f"| {_fmt(e.get('mean_predicted_acceptance'))} "
            f"| {_fmt(e.get('mean_realised_acceptance'))} | {c} | {v} |"
        )
    return lines


def _json_safe(value):
    """NaN (a metric with no data, e.g. a slot no round reached) becomes null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def write(
    result: dict,
    runs: dict[str, Generation],
    prompts: list[Prompt],
    tokenizer,
    out_dir: str | Path,
) -> None:
    """Write report.json, report.md, outputs.jsonl and the PNG plots into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(SpeculateReport.of(result).to_json())
    (out / "report.md").write_text(_markdown(result))
    texts = [prompt_text(p, tokenizer) for p in prompts]
    with open(out / "outputs.jsonl", "w", encoding="utf-8") as f:
        for name, run in runs.items():
            for prompt, text, ids in zip(prompts, texts, run.sequences, strict=True):
                record = {
                    "id": prompt.id,
                    "config": name,
                    "prompt": text,
                    "output_ids": ids,
                    "text": tokenizer.decode(ids, skip_special_tokens=False),
                }
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    latencies = {name: run.token_latency_s for name, run in runs.items()}
    write_plots(result, latencies, out)
