r"""α drift after real fine-tunes of SmolLM2-135M-Instruct: the report, the gate and the repair.

    python -m benchmarks.real_drift --fine-tune bullets --out runs/real-drift/bullets

The fine-tunes are LoRA SFTs (train/finetune.py `sft_adapter`) on the target's own answers to
the training requests (`--answers`: runs/smollm2-data, from `specdistill prepare --recipe
recipes/smollm2-standalone.yaml`), rewritten in a new style, as a user tunes an instruction
model to their house style:

- code-only: the "write a function" requests only, each answered by its code blocks alone (one
  domain, answered in a different style);
- bullets: every request, each answer's prose as bullet points under a fixed lead line (the
  answer format changed everywhere).

Then, each step skipped when its output is there (a rerun resumes):

1. OUT/adapter, and OUT/merged: the merged target, as users also ship it;
2. the drift report and the gates of each --drafts (`specdistill drift` at T = 0 and 1,
   `--fail-if-drop-above 0.02 --fail-if-tau-drop-above 0.02`) on held-out requests
   (`embedded:instructions-heldout`, by kind: write / explain / use) → OUT/drift-<name>;
   the unchanged target against itself → OUT/drift-self;
3. repair data: `specdistill regenerate` with the adapter on the training requests → OUT/regen;
4. repair (benchmarks/drift_repair.py, recipes/repair-smollm2.yaml): the first draft of
   --drafts refit for --refit-steps against a fresh draft from --start (by default the
   merged target's first 4 layers, `target-layers:4`) for --full-steps, α at T = 1 by steps
   on the after-target's answers to the held-out requests;
5. the refit and the fresh draft measured by `specdistill drift` on the same texts
   → OUT/drift-refit, OUT/drift-fresh (the recovered share at T = 0 and 1).

OUT/summary.json and OUT/summary.md hold the tables (`benchmarks/real_drift_tables.py`).
"""

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE = "registry:smollm2-135m-instruct"
STYLES = ("code-only", "bullets")
KIND_PREFIXES = {
    "write": "Write a Python function",
    "explain": "Explain what",
    "use": "How do I use",
}
CODE_BLOCK = re.compile(r"```[^\n`]*\n.*?```", re.S)
BULLET_LEAD = "Key points:"


def kind_of(request: str) -> str:
    """The request's kind in data/instructions.py: write, explain or use."""
    return next((k for k, p in KIND_PREFIXES.items() if request.startswith(p)), "other")


def code_only(answer: str) -> str | None:
    """The answer's code blocks alone (None when it has none)."""
    blocks = CODE_BLOCK.findall(answer)
    return "\n\n".join(blocks) if blocks else None


def bullets(answer: str) -> str | None:
    """The answer's prose as one bullet per sentence under BULLET_LEAD; code blocks kept."""
    parts, at = [], 0
    for m in [*CODE_BLOCK.finditer(answer), None]:
        prose = answer[at : m.start() if m else len(answer)]
        sentences = [s for s in re.split(r"(?<=[.!?:])\s+", prose.strip()) if s.strip()]
        parts += [f"- {' '.join(s.split())}" for s in sentences]
        if m:
            parts.append(m.group(0))
            at = m.end()
    return f"{BULLET_LEAD}\n\n" + "\n".join(parts) if parts else None


def sft_records(answers: str, style: str) -> list[dict]:
    """Chat records for the SFT: each (request, answer) of `answers` (JSONL files, a glob)
    rewritten in `style`; code-only keeps the write requests only."""
    out = []
    for path in sorted(glob.glob(answers)):
        for line in Path(path).read_text().splitlines():
            messages = json.loads(line)["messages"]
            request, answer = messages[0]["content"], messages[-1]["content"]
            if style == "code-only" and kind_of(request) != "write":
                continue
            new = code_only(answer) if style == "code-only" else bullets(answer)
            if new:
                out.append({"messages": [messages[0], {"role": "assistant", "content": new}]})
    if not out:
        raise SystemExit(f"--answers {answers}: no answers to rewrite as {style}")
    return out


def eval_prompts(path: Path, n: int) -> Path:
    """The first `n` held-out requests as chat prompts with their kind as category."""
    from specdistill.data.instructions import stdlib_instructions

    rows = [
        {"id": f"heldout-{i}", "category": kind_of(text),
         "messages": [{"role": "user", "content": text}]}
        for i, text in enumerate(stdlib_instructions("heldout")[:n])
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def specdistill(*argv: str) -> int:
    """One `specdistill` command in its own process (1 thread); its exit status."""
    cmd = [sys.executable, "-m", "specdistill", *argv]
    print("$ specdistill " + " ".join(argv), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, check=False).returncode


def drift(args, out: Path, draft: str, prompts: Path, adapter: Path | None, n: int) -> Path:
    """`specdistill drift` of `draft` (after = the base + `adapter`, or the base alone) at
    T = 0 and 1 with the gates at 0.02 (α) and 2% (τ at γ = 5), into `out` unless its
    gate.json is there."""
    if not (out / "gate.json").is_file():
        after = ["--adapter-after", str(adapter)] if adapter else []
        status = specdistill(
            "drift", "--draft", draft, "--target-before", args.base, "--target-after",
            args.base, *after, "--prompts", str(prompts), "--out", str(out), "--overwrite",
            "--temperature", "0,1", "--fail-if-drop-above", "0.02",
            "--fail-if-tau-drop-above", "0.02", "--tau-gamma", "5", "--num-prompts", str(n),
            "--max-new-tokens", str(args.max_new_tokens), "--batch-size", "16",
            "--threads", "1",
        )  # fmt: skip
        if status not in (0, 1):
            raise SystemExit(f"specdistill drift failed ({status}) for {draft}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--fine-tune", choices=STYLES, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--base", default=BASE)
    p.add_argument("--answers", default="runs/smollm2-data/regen-*.jsonl")
    p.add_argument(
        "--drafts",
        default="standalone=runs/smollm2-standalone/final,eagle3=runs/smollm2-eagle3/final",
        help="NAME=DIR,...; the first is repaired",
    )
    p.add_argument("--sft-steps", type=int, default=60)
    p.add_argument("--sft-batch", type=int, default=4)
    p.add_argument("--sft-lr", type=float, default=2e-3)
    p.add_argument("--eval-prompts", type=int, default=40)
    p.add_argument("--self-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=80)
    p.add_argument("--regen-prompts", type=int, default=128)
    p.add_argument("--refit-steps", type=int, default=30)
    p.add_argument(
        "--full-steps", type=int, default=150,
        help="the fresh draft's steps; 0 skips it (the refit is then measured against the "
        "draft's α before the fine-tune)",
    )  # fmt: skip
    p.add_argument("--start", default="target-layers:4", help="the fresh draft's start")
    p.add_argument(
        "--start-vocab", type=int, default=8192, help="its draft.vocab_size (0: all tokens)"
    )
    p.add_argument("--recipe", default=str(REPO / "recipes" / "repair-smollm2.yaml"))
    p.add_argument("--skip-repair", action="store_true")
    p.add_argument(
        "--fine-tune-only", action="store_true",
        help="make OUT/adapter and OUT/merged, then stop (the drafts may still be training)",
    )  # fmt: skip
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    import torch

    from benchmarks.real_drift_tables import summary, write_summary
    from specdistill.train.finetune import merge_adapter, sft_adapter

    torch.set_num_threads(1)
    t0 = time.time()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    drafts = dict(item.split("=", 1) for item in args.drafts.split(","))
    adapter = out / "adapter"
    if not (adapter / "adapter_config.json").is_file():
        records = sft_records(args.answers, args.fine_tune)
        sft = out / "sft.jsonl"
        sft.write_text("".join(json.dumps(r) + "\n" for r in records))
        torch.manual_seed(0)  # the LoRA's initialisation
        ft = sft_adapter(args.base, adapter, str(sft), args.sft_steps,
                         batch_size=args.sft_batch, lr=args.sft_lr)  # fmt: skip
        (out / "fine_tune.json").write_text(json.dumps({**ft, "records": len(records)}))
        print(f"fine-tune: {ft} ({time.time() - t0:.0f}s)", flush=True)
    if not (out / "merged" / "config.json").is_file():
        merge_adapter(args.base, adapter, out / "merged")
    if args.fine_tune_only:
        return {"adapter": str(adapter), "merged": str(out / "merged")}
    prompts = eval_prompts(out / "prompts_eval.jsonl", args.eval_prompts)
    n = args.eval_prompts
    for name, draft in drafts.items():
        drift(args, out / f"drift-{name}", draft, prompts, adapter, n)
    first_name, first = next(iter(drafts.items()))
    drift(args, out / "drift-self", first, prompts, None, args.self_prompts)
    repair = None if args.skip_repair else run_repair(args, out, first_name, first, prompts)
    result = summary(out, list(drafts), repair, seconds=time.time() - t0)
    write_summary(out, result)
    return result


def run_repair(args, out: Path, name: str, draft: str, prompts: Path) -> dict:
    """Steps 3-5 of the module docstring; benchmarks/drift_repair.py's result."""
    from benchmarks.drift_repair import compare

    regen = out / "regen"
    if not (regen / "manifest.json").is_file() or not glob.glob(str(regen / "regen-*.jsonl")):
        status = specdistill(
            "regenerate", "--out", str(regen),
            "--limit", str(args.regen_prompts), "--max-new-tokens", str(args.max_new_tokens),
            "--temperature", "1", f"target.model={args.base}",
            f"target.adapter={out / 'adapter'}", "data.train=[embedded:instructions]",
        )  # fmt: skip
        if status != 0:
            raise SystemExit(f"specdistill regenerate failed ({status})")
    repair_json = out / "repair" / "repair.json"
    if repair_json.is_file():
        repair = json.loads(repair_json.read_text())
    else:
        # Without a fresh draft the refit's reference is the old draft's α before the fine-tune
        # (T = 1, on the before-target's answers to the same requests).
        report = out / f"drift-{name}" / "T1" / "report.json"
        alpha_ref = None if args.full_steps else json.loads(report.read_text())["alpha_before"]
        repair = compare(
            base=args.base, adapter=str(out / "adapter"), draft=draft,
            train=str(regen / "regen-*.jsonl"),
            eval=str(out / f"drift-{name}" / "T1" / "responses_after.jsonl"),
            out=out / "repair", refit_steps=args.refit_steps, full_steps=args.full_steps,
            start=args.start,
            start_extra=[f"target.model={out / 'merged'}", "target.adapter=null",
                         *([f"draft.vocab_size={args.start_vocab}"] if args.start_vocab else [])],
            recipe=Path(args.recipe), refit_evals=6,
            alpha_ref=alpha_ref,
        )  # fmt: skip
    drift(args, out / "drift-refit", repair["refit_draft"], prompts, out / "adapter",
          args.eval_prompts)  # fmt: skip
    fresh = out / "repair" / "from-start" / "final"
    if fresh.is_dir():
        drift(args, out / "drift-fresh", str(fresh), prompts, out / "adapter", args.eval_prompts)
    return repair


if __name__ == "__main__":
    main(sys.argv[1:])
