"""`specdistill online demo`: serve, shift the traffic's domain, learn from it, compare with OSD.

    specdistill online demo --out runs/demo                 # --minutes 11: the load takes 0.7 of it
    specdistill online demo --out runs/demo --minutes 25    # a longer run

Before the load, with `--shift target` (the default): the served target is `--target` with a
LoRA adapter fine-tuned (`--ft-steps`) on the help topics enciphered with ROT13 (a stand-in for
a new language) mixed with stdlib code, and the draft is first distilled to that served target
on the code traffic pool (`--fit-steps`): production before the shift, a draft fit to its
target on the traffic so far. `--shift traffic` serves `--target` as it is.

In one process, on 127.0.0.1 only:
  1. the online job's first version, DIR/drafts/v000001, is that draft;
  2. the server (serve/server.py `Server`) on the served target with --drafts DIR/drafts and
     --traffic DIR/traffic;
  3. the online job (train/online/job.py) in follow mode on a thread, OUT = DIR/online;
  4. a bounded load generator (specdistill/online_demo/loadgen.py): `--clients` threads of a
     standard-library HTTP client, temperature 1, in three timed phases: code (prompts cut
     from held-out standard-library modules, the domain the embedded models were trained
     on), prose (paragraphs of the interpreter's own help topics, `pydoc_data.topics.topics`,
     in ROT13 under `--shift target`), then code.
At the end the clients, the server and the job are stopped; then OSD's policy (arXiv
2310.07177: an update on every `--osd-batch` records, no replay, no hold-out gate, promote
always, forward KL) runs one pass over the same DIR/traffic (OUT = DIR/osd), and the offline α
(teacher-forced, temperature 1, the gate's `sequence_alpha`) of the initial draft, of the
final `current` of each policy is measured on held-out code and prose that no request used.

`--engine vllm`: vLLM's OpenAI server serves instead, behind the logging proxy, with the adapter
merged into DIR/target, greedy requests, and each promotion redeployed on a second server
(specdistill/online_demo/vllm_loop.py); served acceptance is also read from vLLM's /metrics.

Writes DIR/summary.json (with the windows around the shift: specdistill/online_demo/report.py),
DIR/served_alpha.png (served α over time, the shifts, each promotion and the windows marked)
and DIR/phases.jsonl (each phase's start, as it begins). Served α: eval.stats.alpha_from_counts
over the traffic records' speculative counters.
"""

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdistill import threads
from specdistill.formats.traffic_shards import read_traffic
from specdistill.online_demo.loadgen import (
    FRACTIONS,
    PHASES,
    code_texts,
    prompts_of,
    prose_texts,
    run_load,
    split_pools,
)
from specdistill.online_demo.report import (
    Bootstrap,
    ShiftFigures,
    phase_means,
    plot,
    shift_figures,
)
from specdistill.online_demo.training import fine_tune_target, fit_draft, recipe_for
from specdistill.online_demo.vllm_loop import serve_behind_vllm
from specdistill.online_demo.vllm_report import plot as plot_vllm
from specdistill.online_demo.vllm_report import shift_figures as vllm_figures
from specdistill.serve.options import ServeOptions
from specdistill.serve.server import Server
from specdistill.train.finetune import merge_adapter
from specdistill.train.online.gate import sequence_alpha
from specdistill.train.online.job import OnlineJob
from specdistill.train.online.kept import KeptRecord


# ------------------------------------------------------------------------------ evaluation
def eval_items(
    texts, tokenizer, category: str, n: int, prompt_tokens: int, total_tokens: int
) -> list[KeptRecord]:
    """Teacher-forced sequences: the first `prompt_tokens` ids as prompt, the rest (up to
    `total_tokens`) as completion; temperature 1 like the traffic."""
    items = []
    for i, text in enumerate(texts):
        ids = tokenizer(text)["input_ids"][:total_tokens]
        if len(ids) < prompt_tokens + 8:
            continue
        items.append(
            KeptRecord(
                id=f"eval-{category}-{i}",
                time=0.0,  # held out: never served
                prompt_token_ids=ids[:prompt_tokens],
                completion_token_ids=ids[prompt_tokens:],
                temperature=1.0,
                category=category,
            )
        )
        if len(items) >= n:
            break
    return items


def offline_alpha(job, model, evals: dict) -> dict:
    pad = job.tokenizer.pad_token_id
    return {
        domain: float(np.mean(sequence_alpha(job.kind, job.target, model, items, pad)))
        if items
        else None
        for domain, items in evals.items()
    }


@dataclass
class Served:
    """What the served phase left: the load's answers (`run_load`), the phases' events, the
    online job's result (empty if it failed) and its errors."""

    load: dict
    events: list
    job_result: dict
    job_errors: list[str]
    vllm: dict | None = None  # --engine vllm: serve_behind_vllm's result


@dataclass
class Traffic:
    """The traffic log read back after the load, and what the summary measures on it."""

    records: list
    starts: list[float]  # each phase's start
    promoted: list[tuple[float, str]]  # (time, version) of each promotion
    figures: ShiftFigures


@dataclass
class Osd:
    """OSD's policy run after the fact: its job, its result, seconds and offline α."""

    job: object
    result: dict
    seconds: float
    alpha: dict


def fresh_out(args) -> Path:
    """DIR, made; refused when it holds anything."""
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out}: not empty; the demo needs a fresh directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def phase_lengths(args) -> list[float]:
    """Seconds of the three phases: --phase-seconds, else --minutes' load share split by
    `FRACTIONS`."""
    load_s = args.minutes * 60 * args.load_share
    seconds = (
        [float(x) for x in args.phase_seconds.split(",")]
        if args.phase_seconds
        else [load_s * f for f in FRACTIONS]
    )
    if len(seconds) != 3:
        raise SystemExit("--phase-seconds needs three numbers (code, prose, code)")
    return seconds


def shift_models(args, out: Path, code_traffic: list[str], code_eval: list[str]) -> dict:
    """`--shift target`: the target's adapter (`args.target_adapter`); `--fit-steps`: the
    draft fit to the served target (`args.draft`). The summary's `shift` entry."""
    shift = {"kind": args.shift}
    if args.shift == "target":
        t0 = time.time()
        args.target_adapter, shift["fine_tune"] = fine_tune_target(args, out)
        shift["fine_tune"]["seconds"] = time.time() - t0
        print(f"online demo: served target = {args.target} + {args.target_adapter}", flush=True)
    if args.fit_steps:
        t0 = time.time()
        args.draft = fit_draft(args, out, args.target_adapter, code_traffic, code_eval)
        shift["fit"] = {"steps": args.fit_steps, "draft": args.draft, "seconds": time.time() - t0}
    return shift


def pools_and_evals(args, tokenizer, code: tuple[list, list]) -> tuple[dict, dict]:
    """(the prompt pools the clients send, the held-out sequences of offline α), per
    domain; `code`: the code texts' (traffic, evaluation) split."""
    code_traffic, code_eval = code
    prose_traffic, prose_eval = split_pools(prose_texts(args.shift == "target"), args.seed)
    pools = {
        "code": prompts_of(code_traffic, tokenizer, args.prompt_tokens, args.prompts_per_text),
        "prose": prompts_of(prose_traffic, tokenizer, args.prompt_tokens, args.prompts_per_text),
    }
    print(
        f"online demo: prompt pools: {len(pools['code'])} code, {len(pools['prose'])} prose",
        flush=True,
    )
    sizes = (args.eval_sequences, args.prompt_tokens, args.eval_tokens)
    evals = {
        "code": eval_items(code_eval, tokenizer, "code", *sizes),
        "prose": eval_items(prose_eval, tokenizer, "prose", *sizes),
    }
    return pools, evals


def serve_and_learn(args, out: Path, job, pools: dict, phase_seconds: list[float]) -> Served:
    """The server on DIR/drafts with the traffic log (`--engine vllm`: vLLM behind a logging
    proxy, vllm_loop.py), the online job following it on a thread, and the load; then the
    clients, the server and the job are stopped."""
    if args.engine == "vllm":
        events: list = []

        def load(url: str, body) -> dict:
            return run_load(url, pools, phase_seconds, args, events, out / "phases.jsonl", body)

        got = serve_behind_vllm(args, out, job, load)
        return Served(got["load"], events, got["job_result"], got["job_errors"], got)
    options = ServeOptions(
        target=args.target,
        drafts=str(out / "drafts"),
        traffic=str(out / "traffic"),
        target_adapter=args.target_adapter,
        gamma=args.gamma,
        max_num_seqs=args.clients,
        poll_s=1.0,
        max_tokens=args.max_tokens,
    )
    server = Server(options)
    url = server.start("127.0.0.1", 0)
    print(f"online demo: server on {url} (loopback), drafts {out / 'drafts'}", flush=True)
    job_result, job_errors = {}, []

    def run_job():
        try:
            job_result.update(job.run(follow=True))
        except BaseException as e:  # noqa: BLE001 - reported in the summary
            job_errors.append(repr(e))

    job_thread = threading.Thread(target=run_job, name="online-job", daemon=True)
    job_thread.start()
    events: list = []
    try:
        load = run_load(url, pools, phase_seconds, args, events, out / "phases.jsonl")
    finally:
        server.stop()
        job.stop_event.set()
        job_thread.join(timeout=max(60.0, args.minutes * 60))
    if job_thread.is_alive():
        job_errors.append("the online job did not stop in time")
    return Served(load, events, job_result, job_errors)


def read_back(args, out: Path, events: list) -> Traffic:
    """The traffic log, the phases' starts, the promotions (DIR/online/decisions.jsonl) and
    the windows around the shift (served α per phase, and in the prose phase before and
    after its first promotion)."""
    records = read_traffic(out / "traffic")
    starts = [e["time"] for e in events if e["event"] == "phase"]
    log = out / "online" / "decisions.jsonl"
    decisions = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    promoted = [(d["time"], d["version"]) for d in decisions if d["decision"] == "promoted"]
    boot = Bootstrap(args.bootstrap, 0.95, args.seed)
    figures = shift_figures(
        records, starts, promoted, [d["time"] for d in decisions], args.window, boot
    )
    return Traffic(records, starts, promoted, figures)


def run_osd(args, out: Path, job, evals: dict) -> Osd:
    """OSD's policy, after the fact, on the same recorded traffic."""
    osd_job = OnlineJob(recipe_for(args, out, "osd"), print=lambda *a, **k: None)
    t_osd = time.time()
    result = osd_job.run(follow=False)
    seconds = time.time() - t_osd
    final = osd_job.load_version(osd_job.incumbent()[0])
    return Osd(osd_job, result, seconds, offline_alpha(job, final, evals))


def say(*parts, **_) -> None:
    """The online job's lines, shown as they come."""
    print(*parts, flush=True)


def demo(args) -> dict:
    """The whole demo (module docstring); DIR/summary.json's contents."""
    args.target_adapter = None
    threads.start(args.threads)
    t_start = time.time()
    out = fresh_out(args)
    phase_seconds = phase_lengths(args)
    code = split_pools(code_texts(args.max_code_files), args.seed)
    shift = shift_models(args, out, *code)
    if args.engine == "vllm" and args.target_adapter is not None:
        args.target = str(merge_adapter(args.target, Path(args.target_adapter), out / "target"))
        args.target_adapter = None  # vLLM serves the merged weights; the job reads the same
    job = OnlineJob(recipe_for(args, out, "specdistill"), print=say)
    pools, evals = pools_and_evals(args, job.tokenizer, code)
    alpha_initial = offline_alpha(job, job.load_version("v000001"), evals)
    print(f"online demo: offline α of v000001 {alpha_initial}", flush=True)
    served = serve_and_learn(args, out, job, pools, phase_seconds)
    traffic = read_back(args, out, served.events)
    alpha_final = offline_alpha(job, job.load_version(job.incumbent()[0]), evals)
    outcome = served.job_result or job.summary()
    osd = run_osd(args, out, job, evals)
    plot(
        out / "served_alpha.png",
        traffic.records,
        traffic.starts,
        traffic.promoted,
        args.plot_window,
        traffic.figures,
    )
    summary = {
        **shift_summary(traffic),
        "offline_alpha": {"initial": alpha_initial, "final": alpha_final},
        **{k: outcome[k] for k in JOB_COUNTS},
        "prompt_pool": {k: len(v) for k, v in pools.items()},
        **served_summary(outcome, out, served, traffic, phase_seconds),
        "specdistill": {
            "policy": "specdistill: replay + held-out gate, recipe loss " + args.loss,
            "offline_alpha": alpha_final,
            "final_version": job.incumbent()[0],
            **{k: outcome[k] for k in ("records_trained", "refreshes", "promotions", "rejections")},
        },
        "osd": osd_summary(args, osd),
        "shift": shift,
        "eval_sequences": {k: len(v) for k, v in evals.items()},
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "plot": str(out / "served_alpha.png"),
        "wall_s": time.time() - t_start,
    }
    if served.vllm is not None:
        summary["vllm"] = vllm_summary(out, served, traffic)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def vllm_summary(out: Path, served: Served, traffic: Traffic) -> dict:
    """`--engine vllm`: served acceptance from vLLM's counters around the shift, the
    redeploys, the proxy's counts; the plot DIR/served_alpha_vllm.png."""
    got = served.vllm
    end = next((e["time"] for e in served.events if e["event"] == "end"), None)
    figures = vllm_figures(got["windows"], traffic.starts, end, got["deployments"])
    plot_vllm(out / "served_alpha_vllm.png", got["windows"], traffic.starts, got["deployments"])
    return {
        "from_metrics": figures,
        "deployments": got["deployments"],
        "proxy": got["proxy"],
        "scrape_windows": len(got["windows"]),
        "scrape_errors": got["scrape_errors"],
        "plot": str(out / "served_alpha_vllm.png"),
    }


# ------------------------------------------------------------------------------ the summary
JOB_COUNTS = (  # the online job's record counts in the summary, in its order
    "records_seen",
    "records_trained",
    "records_rejected",
    "records_accepted",
    "duplicates",
    "over_prompt_cap",
)


def shift_summary(traffic: Traffic) -> dict:
    """Served α around the shift: the windows, the drop, the recovery, the return."""
    figures = traffic.figures
    return {
        "alpha_before_shift": figures.before_shift.alpha,
        "alpha_after_shift": figures.after_shift.alpha,
        "drop_at_shift": figures.drop.delta,
        "drop_interval": figures.drop.interval,
        "recovery_records": figures.recovery.records,
        "recovery_seconds": figures.recovery.seconds,
        "recovery_refreshes": figures.recovery.refreshes_after_first_promotion,
        "alpha_original_domain_after": figures.after_return.alpha,
        "original_domain_change": figures.original_domain_change.delta,
        "windows": figures.as_dict(),
        **phase_means(traffic.records, traffic.starts, traffic.promoted),
    }


def served_summary(outcome: dict, out: Path, served: Served, traffic: Traffic, phases) -> dict:
    """The job's refreshes, promotions and rollbacks, the requests served and logged, the
    phases and the promotions' times (`outcome`: the online job's result)."""
    rollbacks = out / "drafts" / "rollbacks.jsonl"
    return {
        "refreshes": outcome["refreshes"],
        "promotions": outcome["promotions"],
        "rollbacks": len(rollbacks.read_text().splitlines()) if rollbacks.exists() else 0,
        "requests_served": len(served.load["served"]),
        "failed_requests": len(served.load["failures"]),
        "failure_examples": served.load["failures"][:3],
        "records_logged": len(traffic.records),
        "job_errors": served.job_errors,
        "phases": [
            {
                "phase": i + 1,
                "domain": PHASES[i],
                "seconds": s,
                "start": traffic.starts[i] if i < len(traffic.starts) else None,
            }
            for i, s in enumerate(phases)
        ],
        "promotion_log": [{"time": t, "version": v} for t, v in traffic.promoted],
    }


def osd_summary(args, osd: Osd) -> dict:
    """OSD's entry: its policy, offline α, final version, records, updates and seconds."""
    return {
        "policy": f"OSD: update every {args.osd_batch} records, no replay, no gate, fkl",
        "offline_alpha": osd.alpha,
        "final_version": osd.job.incumbent()[0],
        "records_trained": osd.result["records_trained"],
        "updates": osd.result["refreshes"],
        "seconds": osd.seconds,
    }


SHOWN = (
    "alpha_before_shift",
    "alpha_after_shift",
    "drop_at_shift",
    "drop_interval",
    "recovery_records",
    "recovery_seconds",
    "recovery_refreshes",
    "alpha_original_domain_after",
    "original_domain_change",
    "alpha_after_refresh",
    "records_seen",
    "records_accepted",
    "duplicates",
    "over_prompt_cap",
    "records_trained",
    "records_rejected",
    "promotions",
    "rollbacks",
    "failed_requests",
    "requests_served",
    "records_logged",
)


def run(args) -> int:
    """`specdistill online demo` once its arguments are parsed (cli.py): the demo, then its
    headline figures; exit status 1 when a request failed, a request was not logged, or
    the job failed."""
    s = demo(args)
    print(json.dumps({k: s[k] for k in SHOWN}, indent=1))
    print(
        "offline α (code, prose): initial",
        s["offline_alpha"]["initial"],
        "specdistill",
        s["specdistill"]["offline_alpha"],
        "osd",
        s["osd"]["offline_alpha"],
    )
    print(f"wrote {Path(args.out) / 'summary.json'} and {s['plot']}")
    ok = (
        s["failed_requests"] == 0
        and s["records_logged"] == s["requests_served"]
        and not s["job_errors"]
    )
    return 0 if ok else 1
