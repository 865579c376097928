"""The speculative-decoding evaluation sweep: one function for the CLI and for training.

Per temperature, the target alone decodes every prompt (the baseline), then the draft +
target decode them at each γ (and with adaptive γ, `Settings.adaptive`); a γ of "auto" is
the per-row draft-length policy (`AutoGamma`, eval/length_policy.py, at most
`Settings.max_gamma` drafts), whose entry adds its drafted-length histogram, mean drafted
length, mean predicted against realised acceptance, and cost model. With
`Settings.repeats` > 1 that whole sequence runs again and each configuration keeps its
fastest run (runs are seeded, so repeats are the same computation, and a slow spell of a
shared machine no longer lands on one configuration only). For each
configuration the result holds measured τ, τ predicted from offline α on the same prompts
and generated text (i.i.d., pathwise at the measured round starts, and with the round
boundaries replayed: `stats.tau_rounds`, the model training reports), per-slot conditional
acceptance, where rejections fall, draft / verify time, tokens/s for speculative and
target-only decoding, the speedup, the ideal speedup and engine efficiency, TTFT and
per-token latency percentiles, and per temperature the best γ. At T=0 each configuration's
outputs are checked against the target alone's (`greedy_check`, eval/lossless.py: every
divergence a near-tie of the target's argmax or a real error).

`python eval/speculative.py` writes it as a report (eval/report.py); the trainer's periodic
evaluation (`eval.speculative.every`) logs τ, speedup and the best γ from it.
"""

import math
from copy import copy
from dataclasses import asdict, dataclass

from specdistill import drafts
from specdistill.eval import stats
from specdistill.eval.cli_args import DEFAULT_MAX_GAMMA
from specdistill.eval.engine import AdaptiveGamma, Generation, generate
from specdistill.eval.length_policy import length_policy
from specdistill.eval.lossless import GreedyChecker
from specdistill.progress import WorkProgress

# |measured τ − predicted τ| / predicted τ within which the i.i.d. prediction agrees.
TAU_TOLERANCE = 0.10


@dataclass
class Settings:
    gammas: list[int | str]  # each ≥ 1, or "auto"
    adaptive: bool = False
    temperatures: tuple[float, ...] = (0.0,)
    top_p: float | None = None  # filters the target's p (None = off)
    top_k: int | None = None
    batch_size: int = 1
    max_new_tokens: int = 128
    eos_token_id: int | None = None
    seed: int = 0
    repeats: int = 1  # runs of every configuration, round-robin; the fastest counts
    max_gamma: int = DEFAULT_MAX_GAMMA  # most drafts per row and round under "auto"

    def __post_init__(self):
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.max_gamma < 1:
            raise ValueError(f"max_gamma must be >= 1, got {self.max_gamma}")
        bad = [g for g in self.gammas if g != "auto" and not (isinstance(g, int) and g >= 1)]
        if bad:
            raise ValueError(f'gammas must be integers >= 1 or "auto", got {bad}')


# The work of scoring one configuration's outputs (offline α: one teacher-forced pass of each
# model over each text) in decoding runs, for the ETA; the rate itself is measured.
SCORING_UNITS = 0.25


def sweep(
    target,
    draft,
    prompt_ids: list[list[int]],
    settings: Settings,
    progress: WorkProgress | None = None,
    *,
    check_greedy: bool = True,
) -> tuple[dict, dict[str, Generation]]:
    """Run every configuration. Returns (result dict, {config name: its `Generation`}).

    result: "settings", "tau_tolerance", "baselines" {temperature: decode stats},
    "configs" [one entry per (temperature, γ); at T=0 with its `GreedyCheck` as
    "greedy_check"], "best_gamma" {temperature: {"measured", "speedup", "predicted",
    "predicted_rounds"}} (temperatures as f"{T:g}"). Models are
    switched to eval mode for the runs and restored; pass the bare models (not DDP /
    accelerate wrappers). `progress` (of `work_units(settings)` units) is told of every
    decoding run with its speed, and of every configuration scored. `check_greedy=False`
    leaves out "greedy_check" (whose first divergence copies the target in a higher
    precision: up to twice its memory again, while the sweep lasts at T=0).
    """
    # Warm-up, so that the first timed run does not pay for lazy initialisation.
    warm = dict(max_new_tokens=4, temperature=0.0)
    generate(target, None, prompt_ids[:1], **warm)
    generate(target, draft, prompt_ids[:1], gamma=2, **warm)
    result: dict = {
        "settings": asdict(settings),
        "tau_tolerance": TAU_TOLERANCE,
        "baselines": {},
        "configs": [],
    }
    runs: dict[str, Generation] = {}
    for temperature in settings.temperatures:
        gammas = _swept_gammas(settings)
        fastest = _fastest_runs(target, draft, prompt_ids, settings, temperature, gammas, progress)
        baseline = fastest[0]
        base_name = f"T={temperature:g} target-only"
        result["baselines"][f"{temperature:g}"] = {"name": base_name, **_decode_stats(baseline)}
        runs[base_name] = baseline
        fixed = []
        # At T=0, each divergence from the target alone: a near-tie or a real error (the
        # checker's high-precision copy of the target, made at the first one, is freed below).
        vocab_size = drafts.compared_vocab_size(target, draft=draft)
        checker = GreedyChecker(target, vocab_size) if temperature == 0 and check_greedy else None
        for gamma, g in zip(gammas, fastest[1:], strict=True):
            entry = _config(target, draft, prompt_ids, settings, temperature, gamma, g, baseline)
            if checker is not None:
                check = checker.check(prompt_ids, baseline.sequences, g.sequences)
                entry["greedy_check"] = asdict(check)
            result["configs"].append(entry)
            runs[entry["name"]] = g
            if progress is not None:
                progress.advance(SCORING_UNITS, f"scored {entry['name']} (offline α)")
            if isinstance(entry["gamma"], int):
                fixed.append(entry)
        checker = None  # before the next temperature decodes
        result.setdefault("best_gamma", {})[f"{temperature:g}"] = _best_gamma(fixed)
    return result, runs


def _swept_gammas(settings: Settings) -> list:
    """The γ of one temperature's configurations: the settings' own, then an `AdaptiveGamma`
    over their range when `settings.adaptive`."""
    gammas: list = list(settings.gammas)
    if settings.adaptive:
        ordered = sorted(g for g in settings.gammas if isinstance(g, int)) or [1, 4]
        gammas.append(
            AdaptiveGamma(
                start=ordered[len(ordered) // 2], min_gamma=ordered[0], max_gamma=ordered[-1]
            )
        )
    return gammas


def _fastest_runs(
    target,
    draft,
    prompt_ids: list[list[int]],
    settings: Settings,
    temperature: float,
    gammas: list,
    progress: WorkProgress | None,
) -> list[Generation]:
    """The target alone, then each γ, decoded `settings.repeats` times round-robin; each
    configuration's fastest run (the baseline first)."""
    fastest: list[Generation | None] = [None] * (1 + len(gammas))  # baseline, then γs
    for repeat in range(settings.repeats):
        for i, gamma in enumerate([None, *gammas]):
            if gamma is None:
                g = _run(target, None, prompt_ids, settings, temperature)
            else:  # a fresh policy, so that every repeat starts alike
                policy = (
                    length_policy(gamma, settings.max_gamma) if gamma == "auto" else copy(gamma)
                )
                g = _run(target, draft, prompt_ids, settings, temperature, gamma=policy)
            if fastest[i] is None or g.wall_s < fastest[i].wall_s:
                fastest[i] = g
            if progress is not None:
                line = _run_line(temperature, gamma, g, fastest[0], repeat, settings.repeats)
                progress.advance(1, line, keep=True)
    return fastest


def _best_gamma(fixed: list[dict]) -> dict:
    """One temperature's best fixed γ: measured, and as the models predict it."""
    best = max(fixed, key=lambda e: e["tokens_per_s"])
    # Among the swept γ, the one the round-boundary τ and the measured c predict fastest.
    priced = [
        e
        for e in fixed
        if not math.isnan(e["tau_pred_rounds"]) and not math.isnan(e["cost_ratio_c"])
    ]
    rounds_best = (
        max(priced, key=lambda e: e["tau_pred_rounds"] / (e["gamma"] * e["cost_ratio_c"] + 1))
        if priced
        else None
    )
    return {
        "measured": best["gamma"],
        "speedup": best["speedup"],
        "predicted": best["best_gamma_predicted"],
        "predicted_rounds": None if rounds_best is None else rounds_best["gamma"],
    }


def work_units(settings: Settings) -> float:
    """The sweep's work for `WorkProgress`: a decoding run is one unit (each decodes the same
    prompts to the same length), the scoring of a configuration `SCORING_UNITS`."""
    configs = len(settings.gammas) + (1 if settings.adaptive else 0)
    runs = len(settings.temperatures) * settings.repeats * (1 + configs)
    return runs + len(settings.temperatures) * configs * SCORING_UNITS


def _run_line(temperature: float, gamma, g: Generation, baseline, repeat: int, repeats: int):
    """A decoding run's line: its configuration, speed and speed against the target alone."""
    label = "target alone" if gamma is None else _label(gamma)
    line = f"T={temperature:g} {label}: {g.tokens_per_s:.1f} tok/s"
    if gamma is not None and baseline is not None:
        line += f", {g.tokens_per_s / baseline.tokens_per_s:.2f}x the target alone"
    if repeats > 1:
        line += f" (run {repeat + 1}/{repeats})"
    return line


def _label(gamma) -> str:
    if isinstance(gamma, AdaptiveGamma):
        return "adaptive γ"
    return "γ=auto" if gamma == "auto" else f"γ={gamma}"


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def _decode_stats(g: Generation) -> dict:
    return {
        "tokens": g.n_tokens,
        "wall_s": g.wall_s,
        "tokens_per_s": g.tokens_per_s,
        "requests_per_s": len(g.sequences) / g.wall_s,
        "ttft_s": stats.percentiles(g.ttft_s),
        "token_latency_s": stats.percentiles(g.token_latency_s),
        "request_latency_s": stats.percentiles(g.latency_s),
        "queue_s": stats.percentiles(g.queue_s),
        "rounds": len(g.rounds),
        "verify_s_per_round": _mean(r.verify_s for r in g.rounds),
        "prefill_s": g.prefill_s,
    }


def _run(target, draft, prompt_ids, settings: Settings, temperature: float, **kwargs):
    return generate(
        target,
        draft,
        prompt_ids,
        temperature=temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        max_new_tokens=settings.max_new_tokens,
        seed=settings.seed,
        batch_size=settings.batch_size,
        eos_token_id=settings.eos_token_id,
        **kwargs,
    )


def _config(target, draft, prompt_ids, settings: Settings, temperature: float, gamma, g, baseline):
    """One configuration's entry from its run `g` and the target-only run `baseline`."""
    measured = _acceptance(g.rounds)
    offline = _offline_alpha(target, draft, prompt_ids, settings, temperature, g)
    adaptive = isinstance(gamma, AdaptiveGamma)
    label = "adaptive" if adaptive else gamma
    entry = {
        "name": f"T={temperature:g} " + (label if isinstance(label, str) else f"gamma={gamma}"),
        "temperature": temperature,
        "gamma": label,
        **_tau_predictions(measured, offline, g, gamma),
        **_alpha_fields(measured, offline),
        **_speed_fields(measured, offline, g, baseline, temperature),
        **_decode_stats(g),
    }
    if gamma == "auto":
        entry.update(_length_stats(g))
    return entry


@dataclass
class _OfflineAlpha:
    """Offline α of one run's texts: `alphas` per request (`stats.positional_alpha`), their
    mean `alpha` (at depth 0 for drafts with per-depth α, `alpha_depth` then per depth), and
    τ predicted from it over the γ the rows drafted."""

    alphas: list
    alpha: float
    alpha_depth: list[float] | None
    tau_pred: float


def _offline_alpha(
    target, draft, prompt_ids, settings: Settings, temperature: float, g: Generation
) -> _OfflineAlpha:
    depth = max([r.gamma for r in g.rounds] + [1])
    alphas = [
        stats.positional_alpha(
            target,
            draft,
            prompt,
            out,
            temperature=temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            depth=depth,
        )
        for prompt, out in zip(prompt_ids, g.sequences, strict=True)
    ]
    used = [k for r in g.rounds if r.gamma > 0 and not r.capped for k in r.row_gammas() if k > 0]
    if drafts.type_of(draft).per_depth_alpha:
        # Per depth k, over the round starts s >= 1 (the target itself emits token 0).
        alpha_depth = [
            _mean(
                per_request[k][s]
                for per_request, out in zip(alphas, g.sequences, strict=True)
                for s in range(1, len(out) - k)
            )
            for k in range(depth)
        ]
        alpha = alpha_depth[0]
        tau_pred = _mean(stats.tau_chain(alpha_depth, gm) for gm in used)
    else:
        # Offline α over the generated positions (the extra entry past the end is not one).
        alpha = _mean(
            a
            for per_request, out in zip(alphas, g.sequences, strict=True)
            for a in per_request[: len(out)]
        )
        alpha_depth = None
        tau_pred = _mean(stats.tau_iid(alpha, gm) for gm in used)
    return _OfflineAlpha(alphas, alpha, alpha_depth, tau_pred)


def _tau_predictions(measured: dict, offline: _OfflineAlpha, g: Generation, gamma) -> dict:
    """Measured τ and τ as each model predicts it, with their relative errors."""
    tau, tau_pred = measured["tau"], offline.tau_pred
    if isinstance(gamma, int):
        tau_rounds = stats.tau_rounds_pooled(offline.alphas, gamma)
    else:
        tau_rounds = math.nan
    return {
        "tau": tau,
        # Over prompts: a prompt's rounds resampled together (`stats.tau_interval`).
        "tau_interval": stats.tau_interval(g.rounds),
        "tau_pred": tau_pred,
        "tau_pred_pathwise": stats.pathwise_tau(g.rounds, offline.alphas),
        # Round boundaries replayed along the text, without the measured round starts
        # (`stats.tau_rounds`; fixed γ only; exact at T=0 with batch size 1 and no EOS stop).
        "tau_pred_rounds": tau_rounds,
        "tau_pred_rounds_error": (tau_rounds - tau) / tau,
        "tau_pred_iid_error": (tau_pred - tau) / tau,
        "tau_gap": (tau - tau_pred) / tau_pred,
        "tau_within_tolerance": abs(tau - tau_pred) <= TAU_TOLERANCE * tau_pred,
    }


def _alpha_fields(measured: dict, offline: _OfflineAlpha) -> dict:
    """α offline and as measured, where rejections fall, and the mean drafted γ."""
    mean_gamma = measured["mean_gamma"]
    return {
        "alpha_offline": offline.alpha,
        "alpha_offline_depth": offline.alpha_depth,
        "alpha_measured": math.nan
        if math.isnan(mean_gamma)
        else stats.alpha_for_tau(measured["tau"], max(1, round(mean_gamma))),
        "acceptance_rate": measured["acceptance_rate"],
        "slot_acceptance": measured["slot_acceptance"],
        "rejection_histogram": measured["rejection_histogram"],
        "no_rejection": measured["no_rejection"],
        "mean_gamma": mean_gamma,
    }


def _speed_fields(
    measured: dict,
    offline: _OfflineAlpha,
    g: Generation,
    baseline: Generation,
    temperature: float,
) -> dict:
    """Draft / verify time, the cost ratios, the speedup against the ideal one, the γ the
    cost model predicts best, and (at T=0) how many outputs are the target's own."""
    c, v = stats.cost_ratios(g.rounds, baseline.rounds)
    ideal = measured["tau"] / (measured["mean_gamma"] * c + 1.0)
    speedup = g.tokens_per_s / baseline.tokens_per_s
    draft_s = sum(r.draft_s for r in g.rounds)
    alpha = offline.alpha
    return {
        "draft_time_share": draft_s / sum(r.round_s for r in g.rounds),
        "draft_s": draft_s,
        "verify_s": sum(r.verify_s for r in g.rounds),
        "cost_ratio_c": c,
        "verify_cost_ratio": v,
        "speedup": speedup,
        "ideal_speedup": ideal,
        "engine_efficiency": speedup / ideal,
        "best_gamma_predicted": stats.best_gamma_model(alpha, c) if not math.isnan(c) else None,
        "target_tokens_per_s": baseline.tokens_per_s,
        # Greedy verification keeps the target's own text: prompts whose output is the
        # target-only run's, token for token (T=0 only; at T>0 only the distribution is).
        "greedy_identical": sum(
            a == b for a, b in zip(g.sequences, baseline.sequences, strict=True)
        )
        if temperature == 0
        else None,
    }


def _acceptance(rounds) -> dict:
    """`stats.acceptance_stats`, or NaN / empty entries when no row proposed a draft."""
    try:
        return stats.acceptance_stats(rounds)
    except ValueError:
        return {
            "tau": math.nan,
            "slot_acceptance": [],
            "rejection_histogram": [],
            "no_rejection": 0,
            "acceptance_rate": math.nan,
            "mean_gamma": math.nan,
        }


def _length_stats(g: Generation) -> dict:
    """A per-row policy's drafted lengths (per row-round), predicted against realised
    acceptance (over the drafts verification reached) and its cost model."""
    histogram: list[int] = []
    predicted = reached = accepted = 0.0
    for s in g.stats:
        for k, n in enumerate(s.drafted_histogram):
            histogram += [0] * (k + 1 - len(histogram))
            histogram[k] += n
        predicted += s.predicted_sum
        reached += s.reached
        accepted += s.reached_accepted
    rounds = sum(histogram)
    return {
        "drafted_length_histogram": histogram,
        "mean_drafted_length": sum(k * n for k, n in enumerate(histogram)) / rounds
        if rounds
        else math.nan,
        "mean_predicted_acceptance": predicted / reached if reached else math.nan,
        "mean_realised_acceptance": accepted / reached if reached else math.nan,
        "cost_model": g.cost,
    }
