"""What the online demo trains before and beside its load: with `--shift target` the served
target's LoRA adapter (`fine_tune_target`), the draft fit to the served target on the code
traffic pool (`fit_draft`), and the recipes of its two online jobs, this project's policy and
OSD's (`recipe_for`)."""

import codecs
import json
from pathlib import Path

from transformers import AutoConfig

from specdistill.data.stdlib import help_topics, stdlib_files
from specdistill.models import hub
from specdistill.train.config import load_recipe
from specdistill.train.finetune import finetune_adapter
from specdistill.train.trainer import Trainer


# ------------------------------------------------------------------------------ shift
def fine_tune_target(args, out: Path) -> tuple[str, dict]:
    """`--shift target`: a LoRA adapter on `--target` fine-tuned on the help topics in ROT13
    (a new language) mixed half and half with training-split stdlib code (the old domain,
    held). The served target is the base with this adapter from the start: a model that
    knows a language its draft was never fit on, as a fine-tuned product model does."""
    files = stdlib_files("train")[: args.ft_code_files]
    code = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    adapter = out / "target-adapter"
    prose = [codecs.encode(t, "rot13") for t in help_topics()[0]]
    sources = [(prose, 4), (code, 4)]
    info = finetune_adapter(
        args.target, adapter, sources, args.ft_steps, lr=args.ft_lr, r=args.ft_rank, seed=args.seed
    )
    return str(adapter), info


def context_cut(target: str, length: int) -> int:
    """`length`, or the target's context (max_position_embeddings) where that is shorter: the
    demo's sequences never run past what the target saw (a tiny test target has 128)."""

    path = hub.local_model_dir(target)
    if path is None:  # a hub id: its config is read where the model loads
        return length
    context = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
    return length if context is None else min(length, context)


def fit_draft(args, out: Path, adapter: str | None, code: list[str], heldout: list[str]) -> str:
    """`--fit-steps N`: the served draft is `--draft` distilled for N steps to the served target
    on the code traffic pool (what production traffic looked like before the shift)."""
    data, evaluation = out / "fit-train.jsonl", out / "fit-eval.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in code))
    evaluation.write_text("".join(json.dumps({"text": t}) + "\n" for t in heldout))
    overrides = {
        "target.model": args.target,
        "target.adapter": adapter,
        "draft.model": args.draft,
        "data.train": [str(data)],
        "data.eval": [str(evaluation)],
        "data.max_length": context_cut(args.target, 256),
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


# ------------------------------------------------------------------------------ the jobs
def recipe_for(args, out: Path, policy: str):
    common = {
        "target.model": args.target,
        "target.adapter": args.target_adapter,
        "draft.model": args.draft,
        "draft.type": "standalone",
        "data.max_length": context_cut(args.target, 512),
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
