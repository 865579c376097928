"""`specdistill online demo`: serve, shift the traffic's domain, learn from it, compare with OSD.

    specdistill online demo --out runs/demo                 # --minutes 25: the load takes 0.7 of it
    specdistill online demo --out runs/demo --minutes 9     # a quick run

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
  4. a bounded load generator (train/online/loadgen.py): `--clients` threads of a
     standard-library HTTP client, temperature 1, in three timed phases: code (prompts cut
     from held-out standard-library modules, the domain the embedded models were trained
     on), prose (paragraphs of the interpreter's own help topics, `pydoc_data.topics.topics`,
     in ROT13 under `--shift target`), then code.
At the end the clients, the server and the job are stopped; then OSD's policy (arXiv
2310.07177: an update on every `--osd-batch` records, no replay, no hold-out gate, promote
always, forward KL) runs one pass over the same DIR/traffic (OUT = DIR/osd), and the offline α
(teacher-forced, temperature 1, the gate's `sequence_alpha`) of the initial draft, of the
final `current` of each policy is measured on held-out code and prose that no request used.

Writes DIR/summary.json (with the windows around the shift: train/online/demo_report.py),
DIR/served_alpha.png (served α over time, the shifts, each promotion and the windows marked)
and DIR/phases.jsonl (each phase's start, as it begins). Served α: eval.stats.alpha_from_counts
over the traffic records' speculative counters.
"""

import codecs
import json
import threading
import time
from pathlib import Path

import numpy as np

from specdistill import threads
from specdistill.train.online.args import demo_parser
from specdistill.train.online.demo_report import (
    Bootstrap,
    phase_means,
    plot,
    shift_figures,
)
from specdistill.train.online.loadgen import (
    FRACTIONS,
    PHASES,
    code_texts,
    prompts_of,
    prose_texts,
    run_load,
    split_pools,
)


# ------------------------------------------------------------------------------ evaluation
def eval_items(texts, tokenizer, category: str, n: int, prompt_tokens: int, total_tokens: int):
    """Teacher-forced sequences: the first `prompt_tokens` ids as prompt, the rest (up to
    `total_tokens`) as completion; temperature 1 like the traffic."""
    items = []
    for i, text in enumerate(texts):
        ids = tokenizer(text)["input_ids"][:total_tokens]
        if len(ids) < prompt_tokens + 8:
            continue
        items.append(
            {
                "id": f"eval-{category}-{i}",
                "prompt_token_ids": ids[:prompt_tokens],
                "completion_token_ids": ids[prompt_tokens:],
                "temperature": 1.0,
                "category": category,
            }
        )
        if len(items) >= n:
            break
    return items


def offline_alpha(job, model, evals: dict) -> dict:
    from specdistill.train.online.gate import sequence_alpha

    pad = job.tokenizer.pad_token_id
    return {
        domain: float(np.mean(sequence_alpha(job.kind, job.target, model, items, pad)))
        if items
        else None
        for domain, items in evals.items()
    }


# ------------------------------------------------------------------------------ shift
def fine_tune_target(args, out: Path) -> tuple[str, dict]:
    """`--shift target`: a LoRA adapter on `--target` fine-tuned on the help topics in ROT13
    (a new language) mixed half and half with training-split stdlib code (the old domain,
    held). The served target is the base with this adapter from the start: a model that
    knows a language its draft was never fit on, as a fine-tuned product model does."""
    from specdistill.data.stdlib import help_topics, stdlib_files
    from specdistill.train.finetune import finetune_adapter

    files = stdlib_files("train")[: args.ft_code_files]
    code = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    adapter = out / "target-adapter"
    prose = [codecs.encode(t, "rot13") for t in help_topics()[0]]
    sources = [(prose, 4), (code, 4)]
    info = finetune_adapter(
        args.target, adapter, sources, args.ft_steps, lr=args.ft_lr, r=args.ft_rank, seed=args.seed
    )
    return str(adapter), info


def fit_draft(args, out: Path, adapter: str | None, code: list[str], heldout: list[str]) -> str:
    """`--fit-steps N`: the served draft is `--draft` distilled for N steps to the served target
    on the code traffic pool (what production traffic looked like before the shift)."""
    from specdistill.train.config import load_recipe
    from specdistill.train.trainer import Trainer

    data, evaluation = out / "fit-train.jsonl", out / "fit-eval.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in code))
    evaluation.write_text("".join(json.dumps({"text": t}) + "\n" for t in heldout))
    overrides = {
        "target.model": args.target,
        "target.adapter": adapter,
        "draft.model": args.draft,
        "data.train": [str(data)],
        "data.eval": [str(evaluation)],
        "data.max_length": 256,
        "data.pack": True,
        "loss.name": args.loss,
        "train.max_steps": args.fit_steps,
        "train.global_batch_size": args.batch,
        "train.micro_batch_size": args.batch,
        "train.lr": args.lr,
        "train.warmup_steps": max(1, args.fit_steps // 10),
        "train.seed": args.seed,
        "train.output_dir": str(out / "fit"),
        "train.save_every": 0,
        "eval.every": 0,
    }
    recipe = load_recipe(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])
    Trainer.from_recipe(recipe).run()
    return str(out / "fit" / "final")


# ------------------------------------------------------------------------------ main
def recipe_for(args, out: Path, policy: str):
    from specdistill.train.config import load_recipe

    common = {
        "target.model": args.target,
        "target.adapter": args.target_adapter,
        "draft.model": args.draft,
        "draft.type": "standalone",
        "data.max_length": 512,
        "train.lr": args.lr,
        "train.seed": args.seed,
        "online.traffic": str(out / "traffic"),
        "online.min_refresh_records": 1,
    }
    if policy == "osd":
        specific = {
            "loss.name": "fkl",
            "train.global_batch_size": args.osd_batch,
            "train.micro_batch_size": args.osd_batch,
            "online.policy": "osd",
            "online.drafts": str(out / "osd" / "drafts"),
            "online.output_dir": str(out / "osd"),
            "online.follow": False,
            "online.refresh_records": args.osd_batch,
            "online.refresh_steps": 1,
            "online.keep_versions": 2,
        }
    else:
        specific = {
            "loss.name": args.loss,
            "train.global_batch_size": args.batch,
            "train.micro_batch_size": args.batch,
            "online.drafts": str(out / "drafts"),
            "online.output_dir": str(out / "online"),
            "online.follow": True,
            "online.poll_s": 1.0,
            "online.refresh_records": args.refresh_records,
            "online.refresh_seconds": 1e9,
            "online.refresh_steps": args.refresh_steps,
            "online.holdout_size": args.holdout,
            "online.min_holdout": min(8, args.holdout),
            "online.recent_size": 4 * args.refresh_records,
            "online.reservoir_size": 4 * args.refresh_records,
            "online.min_category_samples": max(2, args.holdout // 4),
            "online.bootstrap_samples": 500,
            "online.watch_window": max(5, args.refresh_records // 2),
            "online.keep_versions": 1000,
        }
    return load_recipe(None, [f"{k}={json.dumps(v)}" for k, v in {**common, **specific}.items()])


def demo(args) -> dict:

    from specdistill.serve.server import Server
    from specdistill.serve.traffic import read_traffic
    from specdistill.train.online.job import OnlineJob

    threads.start(args.threads)
    t_start = time.time()
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out}: not empty; the demo needs a fresh directory")
    out.mkdir(parents=True, exist_ok=True)
    load_s = args.minutes * 60 * args.load_share
    phase_seconds = (
        [float(x) for x in args.phase_seconds.split(",")]
        if args.phase_seconds
        else [load_s * f for f in FRACTIONS]
    )
    if len(phase_seconds) != 3:
        raise SystemExit("--phase-seconds needs three numbers (code, prose, code)")

    shift = {"kind": args.shift}
    if args.shift == "target":
        t0 = time.time()
        args.target_adapter, shift["fine_tune"] = fine_tune_target(args, out)
        shift["fine_tune"]["seconds"] = time.time() - t0
        print(f"online demo: served target = {args.target} + {args.target_adapter}", flush=True)
    code_traffic, code_eval = split_pools(code_texts(args.max_code_files), args.seed)
    if args.fit_steps:
        t0 = time.time()
        args.draft = fit_draft(args, out, args.target_adapter, code_traffic, code_eval)
        shift["fit"] = {"steps": args.fit_steps, "draft": args.draft, "seconds": time.time() - t0}

    log = []
    say = lambda *a, **k: log.append(" ".join(map(str, a)))  # noqa: E731
    job = OnlineJob(
        recipe_for(args, out, "specdistill"), print=lambda *a, **k: (say(*a), print(*a, flush=True))
    )
    tok = job.tokenizer
    prose_traffic, prose_eval = split_pools(prose_texts(args.shift == "target"), args.seed)
    pools = {
        "code": prompts_of(code_traffic, tok, args.prompt_tokens, args.prompts_per_text),
        "prose": prompts_of(prose_traffic, tok, args.prompt_tokens, args.prompts_per_text),
    }
    print(
        f"online demo: prompt pools: {len(pools['code'])} code, {len(pools['prose'])} prose",
        flush=True,
    )
    evals = {
        "code": eval_items(
            code_eval, tok, "code", args.eval_sequences, args.prompt_tokens, args.eval_tokens
        ),
        "prose": eval_items(
            prose_eval, tok, "prose", args.eval_sequences, args.prompt_tokens, args.eval_tokens
        ),
    }
    initial = job.load_version("v000001")
    alpha_initial = offline_alpha(job, initial, evals)
    print(f"online demo: offline α of v000001 {alpha_initial}", flush=True)

    server = Server(
        args.target,
        drafts_root=str(out / "drafts"),
        traffic=str(out / "traffic"),
        target_adapter=args.target_adapter,
        gamma=args.gamma,
        max_batch=args.clients,
        poll_s=1.0,
        default_max_tokens=args.max_tokens,
    )
    url = server.start("127.0.0.1", 0)
    print(f"online demo: server on {url} (loopback), drafts {out / 'drafts'}", flush=True)
    job_result, job_error = {}, []

    def run_job():
        try:
            job_result.update(job.run(follow=True))
        except BaseException as e:  # noqa: BLE001 - reported in the summary
            job_error.append(repr(e))

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
        job_error.append("the online job did not stop in time")
    records = read_traffic(out / "traffic")
    starts = [e["time"] for e in events if e["event"] == "phase"]

    # served α per phase, and in the prose phase before / after its first promotion
    decisions = (
        [json.loads(x) for x in (out / "online" / "decisions.jsonl").read_text().splitlines()]
        if (out / "online" / "decisions.jsonl").exists()
        else []
    )
    promoted = [(d["time"], d["version"]) for d in decisions if d["decision"] == "promoted"]
    boot = Bootstrap(args.bootstrap, 0.95, args.seed)
    figures = shift_figures(
        records, starts, promoted, [d["time"] for d in decisions], args.window, boot
    )

    final = job.load_version(job.incumbent()[0])
    alpha_final = offline_alpha(job, final, evals)
    specdistill_summary = job_result or job.summary()

    # OSD's policy, after the fact, on the same recorded traffic
    osd_job = OnlineJob(recipe_for(args, out, "osd"), print=lambda *a, **k: None)
    t_osd = time.time()
    osd_result = osd_job.run(follow=False)
    osd_seconds = time.time() - t_osd
    osd_final = osd_job.load_version(osd_job.incumbent()[0])
    alpha_osd = offline_alpha(job, osd_final, evals)

    rollbacks_file = out / "drafts" / "rollbacks.jsonl"
    plot(out / "served_alpha.png", records, starts, promoted, args.plot_window, figures)
    served = load["served"]
    summary = {
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
        **phase_means(records, starts, promoted),
        "offline_alpha": {"initial": alpha_initial, "final": alpha_final},
        "records_seen": specdistill_summary["records_seen"],
        "records_trained": specdistill_summary["records_trained"],
        "records_rejected": specdistill_summary["records_rejected"],
        "records_accepted": specdistill_summary["records_accepted"],
        "duplicates": specdistill_summary["duplicates"],
        "over_prompt_cap": specdistill_summary["over_prompt_cap"],
        "prompt_pool": {k: len(v) for k, v in pools.items()},
        "refreshes": specdistill_summary["refreshes"],
        "promotions": specdistill_summary["promotions"],
        "rollbacks": len(rollbacks_file.read_text().splitlines()) if rollbacks_file.exists() else 0,
        "requests_served": len(served),
        "failed_requests": len(load["failures"]),
        "failure_examples": load["failures"][:3],
        "records_logged": len(records),
        "job_errors": job_error,
        "phases": [
            {
                "phase": i + 1,
                "domain": PHASES[i],
                "seconds": s,
                "start": starts[i] if i < len(starts) else None,
            }
            for i, s in enumerate(phase_seconds)
        ],
        "promotion_log": [{"time": t, "version": v} for t, v in promoted],
        "specdistill": {
            "policy": "specdistill: replay + held-out gate, recipe loss " + args.loss,
            "offline_alpha": alpha_final,
            "final_version": job.incumbent()[0],
            **{
                k: specdistill_summary[k]
                for k in ("records_trained", "refreshes", "promotions", "rejections")
            },
        },
        "osd": {
            "policy": f"OSD: update every {args.osd_batch} records, no replay, no gate, fkl",
            "offline_alpha": alpha_osd,
            "final_version": osd_job.incumbent()[0],
            "records_trained": osd_result["records_trained"],
            "updates": osd_result["refreshes"],
            "seconds": osd_seconds,
        },
        "shift": shift,
        "eval_sequences": {k: len(v) for k, v in evals.items()},
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "plot": str(out / "served_alpha.png"),
        "wall_s": time.time() - t_start,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> int:
    p = demo_parser()
    args = p.parse_args(argv)
    args.target_adapter = None
    if args.minutes <= 0 or args.minutes > 30:
        p.error("--minutes must be in (0, 30]")
    s = demo(args)
    keys = (
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
    print(json.dumps({k: s[k] for k in keys}, indent=1))
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
