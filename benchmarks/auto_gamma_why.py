r"""Why `--gamma auto` is or is not faster than the best fixed γ: four measurements in one run.

    python -m benchmarks.auto_gamma_why --draft runs/code/final --threads 1 \
        --prompts benchmarks/prompts/HumanEval.jsonl.gz --num-prompts 10 --max-new-tokens 64

(a) The cost model's error. The target alone, each fixed `--gammas` value and `auto` decode
    the prompts (batch 1, like `specdistill speculate`); for every round the cost model's
    prediction k·c + v(k) (c and the fitted v as they stood when the round was planned; for a
    fixed γ, auto's final model) is set against the realised draft and verification times,
    and the time outside the rounds (commit, statistics) is counted. c is also given per
    policy as the realised draft time per draft step over the target alone's step.
(b) The ragged verification's overhead: at each `--batch-sizes` B, one target pass over rows
    that propose 1..7 drafts (mean 4, padded to 7) and verify ragged, against the same
    total drafts at a uniform 4 per row, and against the padded pass verified uniform.
(c) A draft step split: the draft's forward, with its hidden state, the sampling, the
    acceptance head (`drafts.confidence.predicted_acceptance`) and the per-row decision
    (`CostRule.keep_drafting`), each timed alone over `--steps` steps on a real context.
(d) The head's calibration at each temperature (eval/calibration.py): its prediction
    against the label α at that temperature (greedy agreement at T = 0), teacher-forced
    along the target alone's text; plus the spread of its predictions, the realised
    acceptance in their lowest and highest fifth, and what the engine's online map
    (eval/online_calibration.py) made of them during the `auto` run.

Timings are the fastest of `--repeats` (b, c) on whatever machine runs it; ratios within
one run are what to read. `--json PATH` writes everything.
"""

import argparse
import json
import math
import time
from statistics import fmean

import torch

from specdistill import drafts
from specdistill.drafts.confidence import acceptance_head, predicted_acceptance
from specdistill.eval.calibration import calibration
from specdistill.eval.cli_args import DEFAULT_MAX_GAMMA
from specdistill.eval.engine import AutoGamma, generate
from specdistill.eval.length_policy import CostRule, PerRowLength
from specdistill.eval.sampling import Sampler
from specdistill.eval.verify import verify_greedy, verify_sampled
from specdistill.losses.acceptance_head import acceptance_label
from specdistill.losses.sampling import probabilities
from specdistill.models.kv_cache import KVStream

RAGGED = [1, 7, 2, 6, 3, 5, 4, 4]  # any even-length prefix has mean 4


class RecordingAuto(PerRowLength):
    """An `AutoGamma` that notes the cost model's c and fitted v(k) as each round is planned."""

    def __init__(self, inner: AutoGamma):
        self.inner, self.max_gamma, self.plans = inner, inner.max_gamma, []

    @property
    def cost(self):
        return self.inner.cost

    def prepare(self, target, draft, vocab_size, batch_size):
        self.inner.prepare(target, draft, vocab_size, batch_size)

    def plan(self, limits, estimates):
        table = self.inner.cost.table(len(limits))
        self.plans.append((table.draft_s or 0.0, table.fitted()))
        return self.inner.plan(limits, estimates)

    def observe(self, batch_size, drafted, verify_s):
        self.inner.observe(batch_size, drafted, verify_s)

    def after_row(self, estimate, drafted, accepted, confidence):
        return self.inner.after_row(estimate, drafted, accepted, confidence)

    def cost_summary(self):
        return self.inner.cost_summary()


def _rel(pred: float, real: float) -> float:
    return (pred - real) / real if real else math.nan


def cost_error(g, plans, step_s: float) -> dict:
    """Predicted against realised round costs of one run (`plans`: (c, v) per round)."""
    rounds = g.rounds
    drafted = [r for r in rounds if r.gamma > 0]
    steps = sum(r.gamma for r in drafted)
    pred_draft = [c * r.gamma for r, (c, _) in zip(rounds, plans, strict=True)]
    pred_verify = [v[r.gamma] for r, (_, v) in zip(rounds, plans, strict=True)]
    real_draft = [r.draft_s for r in rounds]
    real_verify = [r.verify_s for r in rounds]
    pred = [a + b for a, b in zip(pred_draft, pred_verify, strict=True)]
    real = [a + b for a, b in zip(real_draft, real_verify, strict=True)]
    outside = g.wall_s - g.prefill_s - sum(r.round_s for r in rounds)
    by_k: dict[int, list] = {}
    for r, pv in zip(rounds, pred_verify, strict=True):
        by_k.setdefault(r.gamma, []).append((pv, r.verify_s))
    return {
        "rounds": len(rounds),
        "draft_steps": steps,
        "c_over_target_step": (sum(real_draft) / steps / step_s) if steps else math.nan,
        "round_s_pred_over_real": sum(pred) / sum(real) - 1.0,
        "round_s_mean_abs_rel_error": fmean(
            abs(_rel(p, r)) for p, r in zip(pred, real, strict=True)
        ),
        "draft_s_pred_over_real": _rel(sum(pred_draft), sum(real_draft)),
        "verify_s_pred_over_real": _rel(sum(pred_verify), sum(real_verify)),
        "verify_by_k": {
            str(k): {
                "n": len(v),
                "pred_s": fmean(p for p, _ in v),
                "real_s": fmean(x for _, x in v),
            }
            for k, v in sorted(by_k.items())
        },
        "outside_rounds_share": outside / (g.wall_s - g.prefill_s),
        "tokens_per_s": g.tokens_per_s,
    }


def part_a(target, draft, prompt_ids, args, temperature: float) -> tuple[dict, dict]:
    """(per-policy results, extras for (d)) at one temperature."""
    kw = dict(temperature=temperature, max_new_tokens=args.max_new_tokens, batch_size=1)
    generate(target, draft, prompt_ids[:1], gamma=2, max_new_tokens=4)  # warm-up
    base = generate(target, None, prompt_ids, **kw)
    step_s = fmean(r.verify_s for r in base.rounds)
    auto = RecordingAuto(AutoGamma(args.max_gamma))  # calibrated for the draft at its start
    g_auto = generate(target, draft, prompt_ids, gamma=auto, **kw)
    out = {"target_alone": {"tokens_per_s": base.tokens_per_s, "step_s": step_s}}
    out["auto"] = cost_error(g_auto, auto.plans, step_s)
    hist: list[int] = []
    pred_sum = reached = acc = 0
    for s in g_auto.stats:
        hist += [0] * (len(s.drafted_histogram) - len(hist))
        for k, n in enumerate(s.drafted_histogram):
            hist[k] += n
        pred_sum, reached, acc = (
            pred_sum + s.predicted_sum,
            reached + s.reached,
            acc + s.reached_accepted,
        )
    out["auto"]["drafted_length_histogram"] = hist
    out["auto"]["engine_mean_predicted"] = pred_sum / reached if reached else math.nan
    out["auto"]["engine_mean_realised"] = acc / reached if reached else math.nan
    final = g_auto.cost["1"]
    c_end = final["draft_s"] or 0.0
    from specdistill.eval.cost_model import CostTable

    v_end = CostTable(final["verify_s"]).fitted()
    for gamma in args.gammas:
        g = generate(target, draft, prompt_ids, gamma=gamma, **kw)
        out[f"gamma={gamma}"] = cost_error(g, [(c_end, v_end)] * len(g.rounds), step_s)
    calib = auto.inner.calibration
    mapping = {f"{x:g}": calib(x) for x in (0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)}
    return out, {"baseline": base, "online_map": mapping}


def _timed(fn, repeats: int, inner: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def _verify_run(stream, lengths, g: int, ragged: bool, sampled: bool, gen):
    """One target pass over g + 1 tokens per row and its verification, as a function."""
    b, device = len(lengths), lengths.device
    tokens = torch.randint(0, stream.vocab_size, (b, g + 1), generator=gen, device=device)
    valid = torch.ones_like(tokens, dtype=torch.bool)
    kw = {"lengths": lengths} if ragged else {}

    def run():
        logits = stream.forward(tokens, valid, keep=g + 1)
        if sampled:
            p = probabilities(logits, 1.0)
            verify_sampled(p, p[:, :g], tokens[:, 1:], gen, **kw)
        else:
            verify_greedy(logits, tokens[:, 1:], **kw)
        stream.drop_last(torch.full((b,), g + 1, device=device))

    return run


def _fastest(runs: dict, repeats: int, inner: int = 3) -> dict:
    """The fastest time per call of each of `runs`, timed round-robin (a drift of a shared
    machine's speed then falls on all of them)."""
    best = dict.fromkeys(runs, math.inf)
    for _ in range(repeats):
        for name, run in runs.items():
            best[name] = min(best[name], _timed(run, 1, inner))
    return best


@torch.inference_mode()
def part_b(target, vocab_size: int, prompt_ids, batch_sizes, repeats: int) -> dict:
    """Ragged verification against uniform verification of the same drafts in total."""
    device, out = target.device, {}
    gen = torch.Generator(device=device).manual_seed(0)
    for b in batch_sizes:
        lengths = torch.tensor([RAGGED[i % len(RAGGED)] for i in range(b)], device=device)
        if b % 2:
            lengths[-1] = 4  # keep the mean at 4
        stream = KVStream(target, vocab_size, device)
        stream.admit([prompt_ids[i % len(prompt_ids)][-48:] for i in range(b)])
        most = int(lengths.max())
        entry = {"lengths": lengths.tolist()}
        for sampled in (False, True):
            t = _fastest(
                {
                    "ragged_s": _verify_run(stream, lengths, most, True, sampled, gen),
                    "uniform_s": _verify_run(stream, lengths, 4, False, sampled, gen),
                    "padded_uniform_s": _verify_run(stream, lengths, most, False, sampled, gen),
                },
                repeats,
            )
            t["ragged_over_uniform"] = t["ragged_s"] / t["uniform_s"]
            t["mask_cost_over_padded"] = t["ragged_s"] / t["padded_uniform_s"]
            entry["T1" if sampled else "T0"] = t
        out[str(b)] = entry
    return out


def _step_parts(draft, logits, hidden, temperature, table, calib, args) -> dict:
    """Sampling, head and decision of one draft step at `temperature`, timed alone."""
    gen = torch.Generator(device=logits.device).manual_seed(0)
    sampler = Sampler(temperature, None, None, gen)
    token, probs = sampler.draft(logits)
    hidden = hidden if acceptance_head(draft) is not None else None
    conf = predicted_acceptance(draft, logits, token, probs, hidden)
    most = args.max_gamma

    def rule():
        return CostRule(table, [most], lambda s: None, most, calib, [0.7])

    runs = {
        "sample_s": lambda: sampler.draft(logits),
        "head_s": lambda: predicted_acceptance(draft, logits, token, probs, hidden),
        "decide": lambda: rule().keep_drafting(1, conf),
        "rule": rule,
    }
    head = acceptance_head(draft)
    if head is not None:  # the training-time call, which the engine made before predict_rows
        runs["head_predict_s"] = lambda: head.predict(hidden, logits).float().reshape(-1)
    t = _fastest(runs, args.repeats, args.steps)
    t["decision_s"] = t.pop("decide") - t.pop("rule")
    return t


@torch.inference_mode()
def part_c(target, draft, vocab_size, prompt, policy: AutoGamma, args) -> dict:
    """One draft step's parts at batch 1, each timed alone on a real context."""
    device = draft.device
    out: dict = {}
    stream = KVStream(draft, vocab_size, device)
    stream.admit([prompt[:-1]])
    tok = torch.tensor([[prompt[-1]]], device=device)
    valid = torch.ones_like(tok, dtype=torch.bool)
    one = torch.ones(1, dtype=torch.long, device=device)

    def fwd(hidden: bool):
        def run():
            stream.forward(tok, valid, keep=1, hidden=hidden)
            stream.drop_last(one)

        return run

    runs = {"forward_s": fwd(False), "forward_hidden_s": fwd(True)}
    out.update(_fastest(runs, args.repeats, args.steps))
    logits = stream.forward(tok, valid, keep=1, hidden=True)[:, -1]
    hidden = stream.hidden[:, -1]
    table = policy.cost.table(1)
    for t in args.temperatures:
        out[f"T{t:g}"] = _step_parts(draft, logits, hidden, t, table, policy.calibration, args)
    step = out["forward_s"]
    out["over_forward"] = {
        t: {k: v / step for k, v in out[t].items()} for t in (f"T{x:g}" for x in args.temperatures)
    }
    out["hidden_over_forward"] = out["forward_hidden_s"] / step
    return out


@torch.inference_mode()
def part_d(target, draft, vocab_size, prompt_ids, outputs, temperature: float) -> dict:
    """The head's calibration against α at `temperature` along the given texts."""
    head = acceptance_head(draft)
    if head is None:
        return {"head": None}
    preds, labels = [], []
    for prompt, out in zip(prompt_ids, outputs, strict=True):
        ids = torch.tensor([prompt + out[:-1]], device=target.device)
        keep = len(out)
        t_logits = target(input_ids=ids, logits_to_keep=keep).logits[0, :, :vocab_size]
        o = draft(input_ids=ids.to(draft.device), output_hidden_states=True)
        d_logits = o.logits[0, -keep:, :vocab_size]
        hidden = o.hidden_states[-1][0, -keep:]
        preds.append(head.predict(hidden, d_logits).float())
        labels.append(acceptance_label(d_logits, t_logits, temperature=temperature).float())
    pred, label = torch.cat(preds), torch.cat(labels)
    report = calibration(pred, label)
    order = pred.argsort()
    fifth = max(1, len(order) // 5)
    q = torch.quantile(pred, torch.tensor([0.05, 0.5, 0.95]))
    return {
        "n": report.n,
        "ece": report.ece,
        "mean_predicted": float(pred.mean()),
        "mean_label": float(label.mean()),
        "pred_p05_p50_p95": [round(float(x), 3) for x in q],
        "label_lowest_fifth": float(label[order[:fifth]].mean()),
        "label_highest_fifth": float(label[order[-fifth:]].mean()),
        "corr": float(torch.corrcoef(torch.stack([pred, label]))[0, 1]),
    }


def summary(result: dict) -> str:
    """The measurements as short lines (everything is in --json)."""
    lines = ["(a) cost model: predicted / realised − 1 (round, draft, verify), c / target step"]
    for t, a in result["a"].items():
        for name, e in a.items():
            if name == "target_alone":
                continue
            lines.append(
                f"  T={t} {name:8s} {e['tokens_per_s']:6.1f} tok/s"
                f"  round {e['round_s_pred_over_real']:+.2f}"
                f"  draft {e['draft_s_pred_over_real']:+.2f}"
                f"  verify {e['verify_s_pred_over_real']:+.2f}"
                f"  c {e['c_over_target_step']:.3f}"
                f"  outside rounds {e['outside_rounds_share']:.3f}"
            )
            vk = e["verify_by_k"]
            lines.append(
                "      v(k) pred/real: "
                + " ".join(f"{k}:{x['pred_s'] / x['real_s']:.2f}(n{x['n']})" for k, x in vk.items())
            )
    lines.append("(b) ragged verification / uniform with the same drafts (padded uniform)")
    for b, e in result["b"].items():
        lines.append(
            f"  B={b} lengths {e['lengths']}: "
            + "  ".join(
                f"{t} {e[t]['ragged_over_uniform']:.2f} ({e[t]['mask_cost_over_padded']:.2f})"
                for t in ("T0", "T1")
            )
        )
    c = result["c"] or {"forward_s": math.nan, "hidden_over_forward": math.nan, "over_forward": {}}
    lines.append(
        f"(c) draft step, over the draft forward ({c['forward_s'] * 1e6:.0f} us): "
        f"with hidden {c['hidden_over_forward']:.2f}"
    )
    for t, parts in c["over_forward"].items():
        lines.append(f"  {t}: " + "  ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    lines.append("(d) head calibration along the target's text; online map raw -> used")
    for t, d in result["d"].items():
        lines.append(f"  T={t}: {d}")
        lines.append(f"      map {result['online_map'][t]}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="embedded:code-deep")
    p.add_argument("--draft", required=True)
    p.add_argument("--prompts", default="benchmarks/prompts/HumanEval.jsonl.gz")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--gammas", default="3,6", help="fixed γ values compared in (a)")
    p.add_argument("--max-gamma", type=int, default=DEFAULT_MAX_GAMMA)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--batch-sizes", default="1,4,8", help="batch sizes of (b)")
    p.add_argument("--steps", type=int, default=200, help="timed draft steps per part of (c)")
    p.add_argument("--repeats", type=int, default=7, help="round-robin timings in (b), (c)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--parts", default="a,b,c,d", help="which measurements (a, b need no draft)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.gammas = [int(x) for x in args.gammas.split(",") if x]
    args.temperatures = [float(x) for x in args.temperatures.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)

    from specdistill.drafts.loader import load_draft
    from specdistill.eval.prompts import encode_prompts, load_prompts
    from specdistill.models.hub import load_target, load_tokenizer

    parts = set(args.parts.split(","))
    tokenizer = load_tokenizer(args.target)
    target = load_target(args.target, None).eval()
    draft = load_draft(args.draft).eval() if parts & {"a", "c", "d"} else None
    vocab_size = drafts.compared_vocab_size(target, draft=draft)
    prompts = load_prompts(args.prompts, limit=args.num_prompts)
    prompt_ids = encode_prompts(prompts, tokenizer, max_tokens=args.max_prompt_tokens)

    result: dict = {"a": {}, "d": {}, "online_map": {}, "b": {}, "c": None}
    for t in args.temperatures if parts & {"a", "d"} else []:
        a, extra = part_a(target, draft, prompt_ids, args, t)
        result["a"][f"{t:g}"] = a
        result["online_map"][f"{t:g}"] = extra["online_map"]
        if "d" in parts:
            sequences = extra["baseline"].sequences
            result["d"][f"{t:g}"] = part_d(target, draft, vocab_size, prompt_ids, sequences, t)
    if "b" in parts:
        sizes = [int(x) for x in args.batch_sizes.split(",") if x]
        result["b"] = part_b(target, vocab_size, prompt_ids, sizes, args.repeats)
    if "c" in parts:
        policy = AutoGamma(args.max_gamma)
        with torch.inference_mode():
            policy.prepare(target, draft, vocab_size, 1)
        policy.cost.observe_draft(1, 1e-4)
        result["c"] = part_c(target, draft, vocab_size, prompt_ids[0], policy, args)
    print(summary(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
