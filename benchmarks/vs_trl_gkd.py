"""specdistill's trainer against TRL's GKD trainer at equal work: tokens/s, peak memory, α.

    python -m benchmarks.vs_trl_gkd                                   # both cases
    python -m benchmarks.vs_trl_gkd --case embedded --steps 30 --batch 16 --records 1000
    python -m benchmarks.vs_trl_gkd --case large-vocab --steps 4 --batch 4 --out runs/x.json

Needs TRL (`pip install -e '.[bench]'`). Run it as a module from the repository root: as
a script, this folder's own modules would shadow the project's packages.

The same target, draft, data and steps go through `Trainer` (train/trainer.py) and through
TRL's `GKDTrainer` (trl.experimental.gkd) with `lmbda=0` (no on-policy generation) and
`beta=0`, i.e. forward KL(p‖q) on the data's assistant tokens: specdistill's loss `fkl`.
Held equal on both sides:

- data: chat records (a prompt that asks to continue a piece of standard-library code, the
  next piece as the reply), tokenised once by specdistill's data pipeline (assistant tokens
  are the loss positions); TRL gets those very token ids and masks (labels = -100 elsewhere)
  and the same sequences in the same order (the trainer's seeded permutation; TRL's sampler
  set to sequential), right-padded per micro-batch by the same collator;
- the draft's initial weights, fp32 on both sides; TRL's own defaults of bf16 autocast and
  gradient checkpointing are turned off, so both compute the same thing;
- the optimiser: torch AdamW with the recipe's lr, betas (0.9, 0.95) and weight decay, the
  recipe's warmup + cosine schedule (train/trainer.py lr_lambda), handed to TRL as
  `optimizers=`, gradient clipping at train.max_grad_norm, the same micro-batch and
  gradient accumulation, the loss divided once by the global count of loss tokens.

Each run is its own subprocess, one after another. tokens/s = non-padding tokens of the
steps' sequences (the same for every run) ÷ wall seconds of the training loop (specdistill:
the `train_step` calls that `Trainer.run` makes, without its evaluations before and after;
TRL: `train()` from on_train_begin to on_train_end); cpu-tok/s divides by the process's CPU
seconds instead, steadier on a shared machine, where a load that changes during the runs
(TRL's runs first) moves the wall ratios. One torch thread per run by default (--threads).
--trl-defaults adds a TRL row with its own defaults, bf16 autocast and gradient
checkpointing (ratios stay against the fp32 TRL row). Peak memory is the process's peak RSS
(VmHWM), everything included: Python, torch, the libraries each trainer imports, both
models; "train peak" is the peak during the training loop above the RSS when it started
(VmHWM reset through /proc/self/clear_refs), what training itself adds. Held-out α
(T = 1, teacher-forced, Σ min(p, q) per position, eval/offline.py acceptance_sums) of every
trained draft is measured after the loop by the same function on the same held-out chat
records (embedded:code-heldout modules).

Cases:
- embedded: embedded:code target and embedded:code-draft (4,096-token vocabulary, both
  pretrained on the standard library).
- large-vocab: a random-init Llama target (2 layers, hidden 256) and draft (1 layer,
  hidden 128) with a 128,256-token vocabulary (Llama 3's), tied embeddings, saved as HF
  model directories in a temporary folder. Their tokenizer is the embedded one padded with
  unused entries to 128,256 ids, so the data only holds ids < 4,096 while both models (and
  both losses) score all 128,256 columns: full-vocabulary logits dominate memory. The
  target is random, so α there checks that both trainers optimise the same objective
  equally well; it says nothing about a useful draft. specdistill runs with and without
  `loss.chunk_size`.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from benchmarks.vs_trl_gkd_runs import RUNNERS

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Continue this Python code:\n"
LARGE_VOCAB = 128256  # Llama 3's vocabulary


# ------------------------------------------------------------------------------- data
def chat_records(split: str, n: int, prefix_chars: int = 250, reply_chars: int = 550) -> list:
    """n chat records from the standard library's `split` files, spread over all of them:
    the user asks to continue `prefix_chars` characters of code, the assistant replies
    with the next `reply_chars`."""
    from specdistill.data.stdlib import stdlib_files

    pieces = []
    size = prefix_chars + reply_chars
    for path in stdlib_files(split):
        text = path.read_text(encoding="utf-8", errors="replace")
        for start in range(0, len(text) - size + 1, size):
            prefix = text[start : start + prefix_chars]
            reply = text[start + prefix_chars : start + size]
            if prefix.strip() and reply.strip():
                pieces.append((prefix, reply))
    if len(pieces) < n:
        raise SystemExit(f"only {len(pieces)} pieces of {split} code for {n} records")
    step = len(pieces) / n
    return [
        {
            "messages": [
                {"role": "user", "content": PROMPT + prefix},
                {"role": "assistant", "content": reply},
            ]
        }
        for prefix, reply in (pieces[int(i * step)] for i in range(n))
    ]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ------------------------------------------------------------------------------- models
def large_vocab_models(work: Path) -> tuple[str, str]:
    """Random-init Llama target and draft dirs with a LARGE_VOCAB vocabulary and the
    embedded tokenizer padded with unused entries to that size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdistill.models.embedded import resolve_model

    source = Path(resolve_model("embedded:code"))
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    for i in range(len(vocab), LARGE_VOCAB):
        vocab[f"<|unused_{i}|>"] = i
    dirs = []
    for name, seed, size in (("target", 0, (256, 2, 4, 688)), ("draft", 1, (128, 1, 2, 344))):
        hidden, layers, heads, intermediate = size
        config = LlamaConfig(
            vocab_size=LARGE_VOCAB,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            intermediate_size=intermediate,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        torch.manual_seed(seed)
        out = work / f"large-vocab-{name}"
        LlamaForCausalLM(config).save_pretrained(out)
        (out / "tokenizer.json").write_text(json.dumps(tokenizer))
        for f in ("tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(source / f, out / f)
        dirs.append(str(out))
    return dirs[0], dirs[1]


# ------------------------------------------------------------------------------- driver
def _subprocess(spec: dict, work: Path, threads: int | None) -> dict:
    path = work / f"spec-{spec['name']}.json"
    path.write_text(json.dumps(spec))
    command = [sys.executable, "-m", "benchmarks.vs_trl_gkd", "--child", str(path)]
    command += ["--threads", str(threads)] if threads else []
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        raise SystemExit(f"run {spec['name']} failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def case_runs(case: str, args) -> list[tuple[str, str, list[str]]]:
    """(row name, runner, recipe overrides) of a case; the TRL row first (the baseline)."""
    fkl = ["loss.name=fkl"]
    runs = [("TRL GKD (fkl)", "trl", fkl), ("specdistill fkl", "specdistill", fkl)]
    if args.trl_defaults:
        runs.insert(1, ("TRL GKD, bf16 + ckpt", "trl-defaults", fkl))
    if case == "embedded":
        return runs + [("specdistill tv", "specdistill", ["loss.name=tv"])]
    chunk = [f"loss.chunk_size={args.chunk_size}"]
    return runs + [
        (f"specdistill fkl chunk={args.chunk_size}", "specdistill", fkl + chunk),
        (f"specdistill tv chunk={args.chunk_size}", "specdistill", ["loss.name=tv", *chunk]),
    ]


def run_case(case: str, args, work: Path) -> dict:
    steps = args.steps if args.steps else (30 if case == "embedded" else 4)
    batch = args.batch if args.batch else (16 if case == "embedded" else 4)
    micro = min(batch, args.micro_batch if args.micro_batch else 8)
    if case == "embedded":
        target, draft = "embedded:code", "embedded:code-draft"
    else:
        target, draft = large_vocab_models(work)
    overrides = [
        f"target.model={target}",
        f"draft.model={draft}",
        f"data.train={work / 'train.jsonl'}",
        f"data.eval={work / 'heldout.jsonl'}",
        f"data.max_length={args.max_length}",
        "data.pack=false",
        "loss.temperature=1.0",
        f"train.max_steps={steps}",
        f"train.global_batch_size={batch}",
        f"train.micro_batch_size={micro}",
        f"train.lr={args.lr}",
        f"train.warmup_steps={max(1, steps // 10)}",
        "train.seed=0",
        "train.save_every=0",
        "train.overwrite=true",
        "train.resume='no'",
        "eval.every=0",
    ]
    # Held-out α at V = 128k costs seconds per sequence and means little for a random target.
    eval_sequences = args.heldout if case == "embedded" else min(args.heldout, 16)
    base = {
        "recipe": str(REPO / "recipes" / "code-4layer.yaml"),
        "eval_batch": 4 if case == "embedded" else 2,
        "eval_sequences": eval_sequences,
    }
    rows = []
    for name, runner, extra in case_runs(case, args):
        slug = f"{case}-{len(rows)}"
        spec = {
            **base,
            "name": slug,
            "runner": runner,
            "scratch": str(work / slug),
            "overrides": [*overrides, f"train.output_dir={work / slug}", *extra],
        }
        print(f"[{case}] {name} ...", file=sys.stderr, flush=True)
        result = _subprocess(spec, work, args.threads)
        rows.append({"run": name, "runner": runner, "overrides": extra, **result})
    before = _subprocess(
        {**base, "name": f"{case}-before", "runner": "before", "overrides": overrides},
        work,
        args.threads,
    )
    return {
        "case": case,
        "target": target if case == "embedded" else f"random-init Llama, V={LARGE_VOCAB}",
        "draft": draft if case == "embedded" else f"random-init Llama, V={LARGE_VOCAB}",
        "steps": steps,
        "global_batch": batch,
        "micro_batch": micro,
        "max_length": args.max_length,
        "alpha_before": before["alpha"],
        "rows": rows,
    }


def print_case(result: dict) -> None:
    rows = result["rows"]
    trl = rows[0]
    mib = 2**20
    print(
        f"\n{result['case']}: {result['steps']} steps × {result['global_batch']} sequences "
        f"(micro-batch {result['micro_batch']}, max_length {result['max_length']}), "
        f"{trl['tokens']} tokens ({trl['loss_tokens']} loss tokens); held-out α before "
        f"{result['alpha_before']['alpha']:.4f}"
    )
    print(
        f"{'run':<26} {'tok/s':>7} {'×TRL':>6} {'cpu-tok/s':>9} {'×TRL':>6} "
        f"{'peak MiB':>9} {'×TRL':>6} {'train-peak MiB':>14} {'×TRL':>6} {'α T=1':>7} "
        f"{'Δα':>8}"
    )
    for row in rows:
        tps, cps = row["tokens"] / row["seconds"], row["tokens"] / row["cpu_seconds"]
        row["tokens_per_s"], row["cpu_tokens_per_s"] = tps, cps
        trl_tps, trl_cps = trl["tokens"] / trl["seconds"], trl["tokens"] / trl["cpu_seconds"]
        row["ratios"] = {
            "tokens_per_s": tps / trl_tps,
            "cpu_tokens_per_s": cps / trl_cps,
            "peak_rss": row["peak_rss"] / trl["peak_rss"],
            "train_peak_extra": row["train_peak_extra"] / trl["train_peak_extra"],
            "alpha_delta": row["alpha"]["alpha"] - trl["alpha"]["alpha"],
        }
        q = row["ratios"]
        print(
            f"{row['run']:<26} {tps:>7.0f} {q['tokens_per_s']:>6.2f} {cps:>9.0f} "
            f"{q['cpu_tokens_per_s']:>6.2f} {row['peak_rss'] / mib:>9.0f} {q['peak_rss']:>6.2f} "
            f"{row['train_peak_extra'] / mib:>14.0f} {q['train_peak_extra']:>6.2f} "
            f"{row['alpha']['alpha']:>7.4f} {q['alpha_delta']:>+8.4f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--case", choices=["embedded", "large-vocab", "all"], default="all")
    parser.add_argument("--steps", type=int, help="optimiser steps (embedded 30, large-vocab 4)")
    parser.add_argument("--batch", type=int, help="sequences per step (embedded 16, large-vocab 4)")
    parser.add_argument("--micro-batch", type=int, help="sequences per forward (default 8)")
    parser.add_argument("--records", type=int, default=1000, help="training chat records")
    parser.add_argument("--heldout", type=int, default=64, help="held-out chat records")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--chunk-size", type=int, default=256, help="large-vocab chunked rows")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads per run (default 1: on a shared machine, a second thread "
        "mostly spin-waits for a core and makes both wall and CPU time noisy; 0 = torch's)",
    )
    parser.add_argument("--out", default="runs/vs_trl_gkd.json")
    parser.add_argument(
        "--trl-defaults",
        action="store_true",
        help="also run TRL with its own defaults (bf16 autocast, gradient checkpointing)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        spec = json.loads(Path(args.child).read_text())
        print(json.dumps(RUNNERS[spec["runner"]](spec)))
        return
    try:
        import trl
    except ImportError:
        raise SystemExit("needs TRL: pip install -e '.[bench]'") from None

    cases = ["embedded", "large-vocab"] if args.case == "all" else [args.case]
    results = []
    with tempfile.TemporaryDirectory(prefix="vs_trl_gkd-") as tmp:
        work = Path(tmp)
        write_jsonl(work / "train.jsonl", chat_records("train", args.records))
        write_jsonl(work / "heldout.jsonl", chat_records("heldout", args.heldout))
        for case in cases:
            start = time.perf_counter()
            result = run_case(case, args, work)
            result["wall_s"] = time.perf_counter() - start
            print_case(result)
            results.append(result)
    report = {
        "date": date.today().isoformat(),
        "torch": torch.__version__,
        "trl": trl.__version__,
        "device": "cpu",
        "cpus": os.cpu_count(),
        "threads": args.threads or torch.get_num_threads(),
        "records": args.records,
        "heldout": args.heldout,
        "cases": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
