"""Drift demo on the embedded 4-layer code pair: fine-tune the target, see the draft drift, repair.

    python -m benchmarks.drift_demo [--out runs/drift-demo] [--draft runs/code-4layer/final]

1. Fine-tune `embedded:code` with a peft LoRA adapter for a few dozen steps on English prose
   every machine has (the values of `pydoc_data.topics.topics`, the Python docs' topic
   texts; a fifth of the topics are held out), so that the target drifts towards prose.
2. Prompts in two categories: `code` (openings of functions in held-out standard-library
   modules, `embedded:code-heldout`) and `prose` (openings of the held-out topics).
3. Measure the old draft (`--draft`, default `embedded:code-draft`; a distilled one such as
   `runs/code-4layer/final` shows the drift better) before / after the fine-tune
   (eval/drift.py: α with paired bootstrap intervals per category, TV between targets).
4. Repair (benchmarks/drift_repair.py, recipes/repair.yaml): the after-target's responses
   to separate train prompts become the data; the old draft is refit for a few steps and
   compared with training from the draft's starting point (`--start`; by default the
   `draft.model` of the run that produced `--draft` when it is a run's `final/`, e.g.
   `embedded:code-draft` for `runs/code-4layer/final`, else a fresh initialisation) for 10× the
   steps.
5. Re-measure the repaired draft on the same responses: before / after-fine-tune /
   after-repair α with intervals, written to OUT/demo.json and OUT/demo.md.
"""

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdistill.data.stdlib import help_topics
from specdistill.train.finetune import finetune_adapter

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


def code_openings(n: int, seed: int) -> list[str]:
    """Openings of `def` blocks in held-out stdlib modules (a few lines each)."""
    from specdistill.data.stdlib import stdlib_files

    rng = random.Random(seed)
    found = []
    for path in stdlib_files("heldout"):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for i, line in enumerate(lines):
            if line.lstrip().startswith("def ") and i + 3 < len(lines):
                found.append("\n".join(lines[i : i + 3]) + "\n")
    rng.shuffle(found)
    return found[:n]


def prose_openings(texts: list[str], n: int, seed: int) -> list[str]:
    """Spans of ~200 characters starting at sentence starts of held-out topics."""
    rng = random.Random(seed)
    spans = []
    for text in texts:
        for start in range(0, max(1, len(text) - 400), 600):
            cut = text.find(". ", start)
            if cut > 0:
                spans.append(text[cut + 2 : cut + 202])
    rng.shuffle(spans)
    return spans[:n]


def prompts_file(path: Path, code: list[str], prose: list[str]) -> Path:
    with open(path, "w") as f:
        for i, text in enumerate(code):
            f.write(json.dumps({"id": f"code-{i}", "category": "code", "prompt": text}) + "\n")
        for i, text in enumerate(prose):
            f.write(json.dumps({"id": f"prose-{i}", "category": "prose", "prompt": text}) + "\n")
    return path


def cell(report: dict, side: str, greedy: bool = False) -> dict:
    """α with its interval, overall and per category: at the serving temperature, or at
    T=0 (`greedy`)."""
    key = f"alpha_greedy_{side}" if greedy else f"alpha_{side}"
    out = {"all": [report[key], report[f"{key}_ci"]]}
    for name, c in report["per_category"].items():
        if not c["insufficient"]:
            c = c["greedy"] if greedy else c
            out[name] = [c[side], c[f"{side}_ci"]]
    return out


def default_start(draft: str) -> str | None:
    """The starting point of the run that produced `draft` (its `draft.model`), when `draft`
    is a run's `final/` directory next to the run's recipe.yaml; None otherwise."""
    recipe = Path(draft).expanduser().parent / "recipe.yaml"
    if not recipe.is_file():
        return None
    import yaml

    return ((yaml.safe_load(recipe.read_text()) or {}).get("draft") or {}).get("model")


def demo_meta(args, out: Path, eval_file: Path, target) -> dict:
    """The drift report's `meta` (eval/drift_report.py's DriftMeta) for this demo's run."""
    weight = next(target.parameters())
    return {
        "draft": args.draft,
        "target_before": args.base,
        "target_after": f"{args.base} + {out / 'adapter'}",
        "prompts": str(eval_file),
        "max_new_tokens": args.max_new_tokens,
        "device": str(weight.device),
        "dtype": str(weight.dtype).removeprefix("torch."),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="runs/drift-demo")
    p.add_argument("--base", default="embedded:code")
    p.add_argument("--draft", default="embedded:code-draft")
    p.add_argument("--ft-steps", type=int, default=40)
    p.add_argument("--eval-prompts", type=int, default=30, help="per category")
    p.add_argument("--train-prompts", type=int, default=80, help="per category, repair data")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--refit-steps", type=int, default=10)
    p.add_argument("--full-steps", type=int, default=100)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--start",
        default="auto",
        help="the from-start baseline's starting point: a model, 'fresh' (a fresh "
        "initialisation of the draft's architecture) or 'auto' (the draft.model of the run "
        "that produced --draft, else fresh)",
    )
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from specdistill.drafts import loader
    from specdistill.eval import drift
    from specdistill.eval.prompts import load_prompts
    from specdistill.models import hub

    ft = finetune_adapter(args.base, out / "adapter", [(help_topics()[0], 8)], args.ft_steps)
    print(f"fine-tune: {ft} ({time.time() - t0:.0f}s)", flush=True)
    eval_file, train_file = write_prompt_files(out, args.eval_prompts, args.train_prompts)

    tokenizer = hub.load_tokenizer(args.base)
    before = hub.load_target(args.base)
    after = hub.load_target(args.base, str(out / "adapter"))
    old = loader.load_draft(args.draft)
    settings = dict(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                    min_samples=10, bootstrap=1000, batch_size=16)  # fmt: skip
    eval_prompts = load_prompts(eval_file)
    report, responses = drift.measure(before, after, old, tokenizer, eval_prompts, **settings)
    report["meta"] = demo_meta(args, out, eval_file, before)
    drift.write(report, out / "drift", eval_prompts, responses, tokenizer)
    print(f"drift measured ({time.time() - t0:.0f}s): α {report['alpha_before']:.4f} -> "
          f"{report['alpha_after']:.4f}, TV {report['target_tv']:.4f}", flush=True)  # fmt: skip

    write_repair_data(args, out, after, tokenizer, train_file, eval_prompts, responses["after"])
    print(f"repair data written ({time.time() - t0:.0f}s)", flush=True)
    start, repair = run_repair(args, out)
    print(f"repair done ({time.time() - t0:.0f}s)", flush=True)

    repaired = loader.load_draft(repair["refit_draft"])
    scratch = loader.load_draft(str(out / "repair" / "from-start" / "final"))
    after_repair, _ = drift.measure(before, after, repaired, tokenizer, eval_prompts, **settings)
    from_start, _ = drift.measure(before, after, scratch, tokenizer, eval_prompts, **settings)
    measured = Measured(report, after_repair, from_start)
    result = demo_result(args, start, ft, measured, repair, t0)
    (out / "demo.json").write_text(json.dumps(result, indent=1))
    lines = alpha_markdown(args.temperature, result["alpha"], result["alpha_greedy"])
    (out / "demo.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({k: v for k, v in result.items() if k not in ("alpha", "refit_curve",
                      "from_start_curve")}, indent=1))  # fmt: skip
    return result


def write_prompt_files(out: Path, n_eval: int, n_train: int) -> tuple[Path, Path]:
    """OUT/prompts_eval.jsonl (`n_eval` prompts per category) and OUT/prompts_train.jsonl
    (`n_train` per category, the repair data's prompts), code and prose alike."""
    _, heldout_topics = help_topics()
    code = code_openings(n_eval + n_train, seed=1)
    prose = prose_openings(heldout_topics, n_eval + n_train, seed=1)
    eval_file = prompts_file(out / "prompts_eval.jsonl", code[:n_eval], prose[:n_eval])
    train_file = prompts_file(out / "prompts_train.jsonl", code[n_eval:], prose[n_eval:])
    return eval_file, train_file


def write_repair_data(args, out: Path, after, tokenizer, train_file, eval_prompts, eval_out):
    """Repair data: the after-target's responses to the train prompts (and to the eval
    prompts, `eval_out`, as the trainer's held-out set)."""
    from specdistill.eval import drift
    from specdistill.eval.prompts import encode_prompts, load_prompts

    train_prompts = load_prompts(train_file)
    gen = dict(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
               eos_token_id=tokenizer.eos_token_id, batch_size=16)  # fmt: skip
    train_out = drift.generate_responses(after, encode_prompts(train_prompts, tokenizer), **gen)
    drift.save_responses(out / "repair_train.jsonl", train_prompts, train_out, tokenizer)
    drift.save_responses(out / "repair_eval.jsonl", eval_prompts, eval_out, tokenizer)


def run_repair(args, out: Path) -> tuple[str | None, dict]:
    """(the from-start run's starting point, None for fresh; benchmarks/drift_repair.py's
    comparison of the refit against it, in OUT/repair)."""
    from benchmarks.drift_repair import compare

    start = default_start(args.draft) if args.start == "auto" else args.start
    start = None if start in (None, "fresh") else start
    repair = compare(
        base=args.base, adapter=str(out / "adapter"), draft=args.draft,
        train=str(out / "repair_train.jsonl"), eval=str(out / "repair_eval.jsonl"),
        out=out / "repair", refit_steps=args.refit_steps, full_steps=args.full_steps,
        start=start,
    )  # fmt: skip
    return start, repair


@dataclass
class Measured:
    """The demo's drift reports on the eval prompts: the old draft's (`report`, before and
    after the fine-tune), the refit draft's and the from-start draft's."""

    report: dict
    after_repair: dict
    from_start: dict

    def alpha_table(self, args, greedy: bool = False) -> dict:
        """Row name -> `cell`: α at the serving temperature, or at T=0 (`greedy`)."""
        return {
            "before (old draft, old target)": cell(self.report, "before", greedy=greedy),
            "after fine-tune (old draft, new target)": cell(self.report, "after", greedy=greedy),
            f"after repair ({args.refit_steps} steps)": cell(
                self.after_repair, "after", greedy=greedy
            ),
            f"from start ({args.full_steps} steps)": cell(self.from_start, "after", greedy=greedy),
        }


def demo_result(args, start: str | None, ft, measured: Measured, repair: dict, t0: float) -> dict:
    """OUT/demo.json: the α tables, the drift's split, the verdicts and the repair curves."""
    report, after_repair, from_start = measured.report, measured.after_repair, measured.from_start
    gap = report["alpha_before"] - report["alpha_after"]
    return {
        "draft": args.draft,
        "start": start or "fresh",
        "settings": vars(args),
        "fine_tune": ft,
        "alpha": measured.alpha_table(args),
        "alpha_greedy": measured.alpha_table(args, greedy=True),
        "target_tv": report["target_tv"],
        "drop_from_text": report["drop_from_text"],
        "drop_from_target": report["drop_from_target"],
        "verdict": report["verdict"],
        "repair_recovered_vs_before": (after_repair["alpha_after"] - report["alpha_after"]) / gap
        if gap > 0
        else None,
        "verdict_after_repair": after_repair["verdict"],
        "from_start_vs_before": from_start["alpha_after"] - report["alpha_before"],
        "repair_benchmark": {k: v for k, v in repair.items() if k not in ("refit", "from_start")},
        "refit_curve": repair["refit"]["curve"],
        "from_start_curve": repair["from_start"]["curve"],
        "seconds": time.time() - t0,
    }


def alpha_markdown(temperature: float, table: dict, greedy: dict) -> list[str]:
    """OUT/demo.md's lines: the α tables at the serving temperature and at T=0."""
    lines = []
    for title, rows in ((f"α at T={temperature:g}", table), ("α at T=0", greedy)):
        lines += ["", f"{title}:", "", "| | all | code | prose |", "|---|---|---|---|"]
        for name, cells in rows.items():
            row = [f"{v[0]:.4f} [{v[1][0]:.4f}, {v[1][1]:.4f}]" if v else "n/a"
                   for v in (cells.get("all"), cells.get("code"), cells.get("prose"))]  # fmt: skip
            lines.append(f"| {name} | " + " | ".join(row) + " |")
    return lines[1:]


if __name__ == "__main__":
    main(sys.argv[1:])
