"""The distillation loop: a frozen target, a trainable draft, an acceptance-optimising loss.

One optimiser step consumes `train.global_batch_size` sequences, split over processes and
micro-batches. The loss of a step is Σ(per-position loss) / (valid positions in the whole
global batch), so gradient accumulation and the number of processes do not change it.
The order of sequences is a function of (seed, step) alone, which makes a resumed run
replay exactly what an uninterrupted one would have seen.

Around the loop, the run's lifecycle is made safe to kill and to rerun: the output_dir and
the resume are validated before any model loads (`prepare_output_dir`), checkpoints, final/
and eval.json are published atomically (specdistill/publish.py), a damaged checkpoint falls
back to the previous one, and metrics.jsonl is cut back to the resumed checkpoint. What is
guaranteed, and the test of each guarantee: docs/reliability.md.
"""

import ast
import json
import logging
import math
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from specdistill import losses
from specdistill.data import build_datasets, collate
from specdistill.drafts.align import shifted_hidden, target_mask
from specdistill.eval.offline import acceptance_sums, summarise
from specdistill import drafts
from specdistill.drafts import hub as models
from specdistill.publish import atomic_write_text, publish_dir
from specdistill.train.config import (
    Recipe,
    RecipeError,
    dump_recipe,
    load_recipe,
    recipe_to_dict,
)
from specdistill.drafts.eagle3_head import Eagle3Head
from specdistill.drafts.embedded import resolve_model

CHECKPOINT_PREFIX = "step-"


def trainable_parameters(module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


STATE_FILE = "trainer_state.json"
# Recipe keys a resumed run may change: they do not change the trained draft. Everything else
# (target, draft, data, loss, the rest of train, the seed) does, and is refused.
HARMLESS_KEYS = {
    "train.save_every",
    "train.keep_checkpoints",
    "train.log_every",
    "train.resume",
    "train.overwrite",
    "train.output_dir",
}
HARMLESS_SECTIONS = ("eval.", "wandb.")
# Where accelerate logs "Removed shared tensor ... while saving" (clean_state_dict_for_safetensors)
ACCELERATE_SAVE_LOGGER = "accelerate.utils.other"


class CheckpointError(ValueError):
    """No checkpoint to resume from could be loaded; the message names each one and why."""


@dataclass
class RunPlan:
    """What `prepare_output_dir` decided, before any model is loaded."""

    out: Path
    resume_from: list[Path]  # checkpoints to try, newest first (then older ones); [] = fresh
    finished: dict | None = None  # eval.json of a complete run of this recipe: nothing to do
    clear: bool = False  # train.overwrite=true on a non-empty output_dir


def list_checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints in `out`, oldest first (a partial one is still a .tmp-* dir)."""
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.glob(f"{CHECKPOINT_PREFIX}*") if (p / STATE_FILE).is_file()]
    return sorted(done, key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    return int(path.name.removeprefix(CHECKPOINT_PREFIX))


def prepare_output_dir(recipe: Recipe) -> RunPlan:
    """Check train.output_dir and train.resume against each other and against what is on disk,
    before any model or data is loaded (minutes on a real model) and before anything is
    written: a run that cannot go on must fail at once and leave an earlier run untouched.

    A non-empty output_dir is refused unless the run resumes (train.resume=auto or a path) or
    replaces it (train.overwrite=true): two runs in one directory would mix their metrics,
    final/ and checkpoints. A run resumes only a checkpoint whose recipe differs from this one
    in keys that do not change the trained draft (`recipe_changes`). With train.resume=auto,
    a run that is already complete is reported as `finished` instead of trained again.
    """
    t = recipe.train
    out = Path(t.output_dir)
    if out.exists() and not out.is_dir():
        raise RecipeError(f"train.output_dir {out} exists and is not a directory")
    used = out.is_dir() and any(out.iterdir())
    if t.resume not in ("no", "auto"):
        path = Path(t.resume)
        if not (path / STATE_FILE).is_file():
            raise RecipeError(
                f"train.resume: {path} is not a checkpoint directory (it has no {STATE_FILE}); "
                f"name one of {out / 'checkpoints'}/{CHECKPOINT_PREFIX}*, or pass "
                "train.resume=auto for the newest one"
            )
        if t.overwrite and out.resolve() in (path.resolve(), *path.resolve().parents):
            raise RecipeError(
                f"train.overwrite=true would delete train.resume={path}: it lies in "
                f"train.output_dir {out}"
            )
        check_recipe(path / "recipe.yaml", recipe)
        return RunPlan(out, [path], clear=used and t.overwrite)
    if t.overwrite or not used:
        return RunPlan(out, [], clear=used)
    if t.resume == "no":
        raise RecipeError(
            f"train.output_dir {out} is not empty (it holds an earlier run); pass "
            "train.resume=auto to continue that run, or train.overwrite=true to delete it and "
            "start over (or choose another train.output_dir)"
        )
    found = list_checkpoints(out)[::-1]
    for path in found:
        check_recipe(path / "recipe.yaml", recipe)
    if not found:
        if not (out / "recipe.yaml").is_file():
            raise RecipeError(
                f"train.resume=auto: train.output_dir {out} is not empty but holds no run "
                "(no recipe.yaml, no checkpoint); pass train.overwrite=true to delete its "
                "contents, or choose another train.output_dir"
            )
        check_recipe(out / "recipe.yaml", recipe)
    report = _read_report(out)
    if report is not None and report.get("steps") == t.max_steps:
        return RunPlan(out, found, finished=report)
    if report is not None and not found:
        raise RecipeError(
            f"train.resume=auto: {out} holds a finished run of {report.get('steps')} steps and "
            f"no checkpoint to continue it to train.max_steps={t.max_steps} from; pass "
            "train.overwrite=true to train again from the start"
        )
    return RunPlan(out, found)


def _read_report(out: Path) -> dict | None:
    """eval.json of a complete run in `out`: written last, after final/ (`Trainer.save_final`)."""
    if not (out / "final").is_dir():
        return None
    try:
        return json.loads((out / "eval.json").read_text())
    except (OSError, ValueError):
        return None


def check_recipe(saved: Path, recipe: Recipe) -> list[str]:
    """Refuse to continue the run whose recipe is `saved` if `recipe` differs from it in a key
    that changes the trained draft; return the harmless changes ('key: old → new')."""
    try:
        old = load_recipe(saved)
    except RecipeError as e:
        raise RecipeError(f"train.resume: cannot read the run's recipe {saved}: {e}") from None
    altering, harmless = recipe_changes(old, recipe)
    if altering:
        raise RecipeError(
            f"train.resume: the run in {saved.parent} was trained with a different recipe; "
            f"these changes would alter the trained draft: {'; '.join(altering)}. Resume "
            "with the run's values, or start a new run (another train.output_dir, or "
            "train.overwrite=true)"
        )
    return harmless


def recipe_changes(old: Recipe, new: Recipe) -> tuple[list[str], list[str]]:
    """(changes that alter the trained draft, changes that do not), each 'key: old → new'.

    train.max_steps may grow (the run trains on; the cosine schedule stretches from the
    resumed step), not shrink: the checkpoint may already be past the new end.
    """
    a, b = _flatten(recipe_to_dict(old)), _flatten(recipe_to_dict(new))
    altering, harmless = [], []
    for key in [*b, *(k for k in a if k not in b)]:
        before, after = a.get(key, "<unset>"), b.get(key, "<unset>")
        if before == after:
            continue
        line = f"{key}: {before} → {after}"
        if key == "train.max_steps":
            (harmless if after > before else altering).append(line)
        elif key in HARMLESS_KEYS or key.startswith(HARMLESS_SECTIONS):
            harmless.append(line)
        else:
            altering.append(line)
    return altering, harmless


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def restore_int_keys(metrics: dict | None) -> dict | None:
    """JSON turns the integer γ keys of tau_pred into strings ("5"); give them back, so that
    `tau_pred[5]` works on a result read from trainer_state.json or eval.json."""
    if metrics is None:
        return None
    return {
        key: {int(g): t for g, t in value.items()}
        if key.startswith("tau_pred") and isinstance(value, dict)
        else value
        for key, value in metrics.items()
    }


def remove_leftovers(out: Path) -> None:
    """Delete what a kill left of an atomic publish (specdistill/publish.py): temporary dirs
    and files, and replaced dirs not yet deleted. None of them is ever read."""
    for folder in (out, out / "checkpoints"):
        for path in (*folder.glob(".tmp-*"), *folder.glob(".old-*"), *folder.glob(".*.tmp-*")):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def progress_line(record: dict, max_steps: int) -> str:
    """One plain log line, for a log that is not a terminal (a progress bar's carriage-return
    redraws would fill it with hundreds of partial lines)."""
    return (
        f"step {record['step']}/{max_steps} | loss {record['loss']:.4f} | "
        f"alpha {record['alpha']:.4f} | lr {record['lr']:.2e} | {record['elapsed_s']:.1f} s"
    )


class TiedHeadWarningFilter(logging.Filter):
    """Drops accelerate's "Removed shared tensor {...} while saving" when the removed tensors
    are exactly the draft's output head tied to its input embeddings. safetensors cannot store
    one tensor twice, and from_pretrained / load_state tie the head again, so for a tied head
    the warning is noise printed at every checkpoint. Any other removed tensor still warns."""

    PATTERN = re.compile(r"Removed shared tensor (\{.*?\}) while saving")

    def __init__(self, names: set[str]):
        super().__init__()
        self.names = names

    def filter(self, record: logging.LogRecord) -> bool:
        match = self.PATTERN.search(record.getMessage())  # after accelerate's "[RANK i] "
        return match is None or not ast.literal_eval(match.group(1)) <= self.names


def tied_head_names(model) -> set[str]:
    """State-dict names of `model`'s output head weight when it is the input embedding matrix,
    with and without DDP's "module." prefix (accelerate saves the wrapped model)."""
    try:
        head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return set()
    if head is None or embeddings is None or head.weight is not embeddings.weight:
        return set()
    names = {f"{name}.weight" for name, module in model.named_modules() if module is head}
    return names | {f"module.{name}" for name in names}


@contextmanager
def quiet_library_bars():
    """No transformers / hub progress bars ("Loading weights", "Writing model shards") while
    stderr is not a terminal: in a log file each one is a line of carriage-return redraws."""
    from transformers.utils import logging as hf_logging

    if sys.stderr.isatty() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


@contextmanager
def quiet_tied_head_warning(model):
    """While saving `model`: no "Removed shared tensor" warning for its tied output head."""
    noise = TiedHeadWarningFilter(tied_head_names(model))
    logger = logging.getLogger(ACCELERATE_SAVE_LOGGER)
    logger.addFilter(noise)
    try:
        yield
    finally:
        logger.removeFilter(noise)


class Trainer:
    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        r = recipe
        # Before any model load: a run that cannot go on fails in seconds, writing nothing.
        self.plan = prepare_output_dir(recipe)
        self.out = self.plan.out
        self.step = 0
        self.alpha_before: dict | None = None
        self.history: list[dict] = []
        self._perms: dict[int, torch.Tensor] = {}
        self._wandb = None
        # cpu=True without a GPU: processes started by torchrun / `accelerate launch --multi_gpu`
        # then form a gloo group (accelerate only does that when told it is on the CPU).
        self.accelerator = Accelerator(
            mixed_precision=r.train.mixed_precision, cpu=not torch.cuda.is_available()
        )
        acc = self.accelerator
        set_seed(r.train.seed)
        if self.plan.finished is not None:
            return  # nothing to train: run() reports the stored result
        world = acc.num_processes
        per_step = r.train.micro_batch_size * world
        if r.train.global_batch_size % per_step:
            raise RecipeError(
                f"train.global_batch_size ({r.train.global_batch_size}) must be a multiple of "
                f"train.micro_batch_size × processes ({r.train.micro_batch_size} × {world})"
            )
        self.accum = r.train.global_batch_size // per_step

        # Only the main process builds an embedded model; the others wait, then load it.
        with acc.main_process_first(), quiet_library_bars():
            self.tokenizer = models.load_tokenizer(r.target.model, r.target.revision)
            if r.draft.type == "standalone":  # an eagle3 head is built below, on the target
                draft_tok = models.load_tokenizer(r.draft.model, r.draft.revision)
                models.check_tokenizers(self.tokenizer, draft_tok, r.target.model, r.draft.model)
                draft = models.load_model(
                    r.draft.model, dtype=r.draft.dtype, revision=r.draft.revision
                )
            self.target = models.load_model(
                r.target.model, dtype=r.target.dtype, revision=r.target.revision
            )
            self.train_data, self.eval_data = build_datasets(
                self.tokenizer,
                r.data.train,
                r.data.eval,
                max_length=r.data.max_length,
                pack=r.data.pack,
                eval_fraction=r.data.eval_fraction,
                skip_malformed=r.data.skip_malformed,
                seed=r.train.seed,
            )
        if r.draft.type == "standalone":
            self.vocab_size = models.shared_vocab_size(self.target, draft, self.tokenizer)
            self.kind = drafts.Standalone(self.vocab_size)
        else:
            self.vocab_size = models.shared_vocab_size(self.target, None, self.tokenizer)
            draft = self._eagle3_head()
            self.kind = drafts.Eagle3(draft, r.draft.ttt_steps, self.vocab_size)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.target.eval().requires_grad_(False).to(acc.device)
        if r.draft.lora.r > 0:
            draft = self._wrap_lora(draft)
        draft.train()

        params = [p for p in draft.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=r.train.lr, weight_decay=r.train.weight_decay, betas=(0.9, 0.95)
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s: lr_lambda(s, r.train.warmup_steps, r.train.max_steps, r.train.min_lr_ratio),
        )
        self.draft, self.optimizer = acc.prepare(draft, optimizer)
        acc.register_for_checkpointing(self.scheduler)

    def _eagle3_head(self):
        d = self.recipe.draft
        if d.model is None:
            head = drafts.eagle3.new_eagle3_head(self.target, d, self.train_data, self.vocab_size)
        elif drafts.Eagle3.detect(d.model):
            head = Eagle3Head.from_pretrained(d.model)
            if head.config.vocab_size != self.vocab_size:
                raise RecipeError(
                    f"draft.model {d.model} is a head over {head.config.vocab_size} tokens; "
                    f"the target's tokenizer has {self.vocab_size}"
                )
        else:
            raise RecipeError(
                f"draft.type=eagle3: draft.model must be null (a fresh head) or an EAGLE-3 "
                f"checkpoint directory, got {d.model!r}"
            )
        head.lm_head.weight.requires_grad_(not d.freeze_lm_head)
        self.accelerator.print(
            f"eagle3 head: aux layers {head.aux_layers}, V_d {head.draft_vocab_size}, "
            f"{trainable_parameters(head) / 1e6:.2f}M trainable parameters"
        )
        return head.to(models.DTYPES[d.dtype])

    def _wrap_lora(self, draft):
        from peft import LoraConfig, get_peft_model

        lora = self.recipe.draft.lora
        config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules,
            task_type="CAUSAL_LM",
        )
        return get_peft_model(draft, config)

    # ----------------------------------------------------------------------------- data
    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.recipe.train.seed * 100_003 + epoch)
            self._perms = {epoch: torch.randperm(len(self.train_data), generator=g)}
        return self._perms[epoch]

    def micro_batches(self, step: int) -> list[dict]:
        """This process's micro-batches for optimiser step `step` (a pure function of step)."""
        g = self.recipe.train.global_batch_size
        n = len(self.train_data)
        indices = [int(self._permutation(i // n)[i % n]) for i in range(step * g, (step + 1) * g)]
        acc = self.accelerator
        share = g // acc.num_processes
        mine = indices[acc.process_index * share : (acc.process_index + 1) * share]
        mb = self.recipe.train.micro_batch_size
        return [self._collate(self.train_data, mine[i : i + mb]) for i in range(0, share, mb)]

    def _collate(self, dataset, indices: list[int]) -> dict:
        batch = collate([dataset[i] for i in indices], self.tokenizer.pad_token_id)
        return {k: v.to(self.accelerator.device) for k, v in batch.items()}

    def eval_batches(self) -> list[dict]:
        acc = self.accelerator
        n = min(len(self.eval_data), self.recipe.eval.max_sequences)
        mine = list(range(acc.process_index, n, acc.num_processes))
        mb = self.recipe.train.micro_batch_size
        return [self._collate(self.eval_data, mine[i : i + mb]) for i in range(0, len(mine), mb)]

    # ----------------------------------------------------------------------------- steps
    def train_step(self, step: int) -> dict:
        acc, r = self.accelerator, self.recipe
        batches = self.micro_batches(step)
        n_local = sum(int(self.kind.count_mask(b).sum()) for b in batches)
        n_global = acc.reduce(torch.tensor(n_local, device=acc.device), "sum").item()
        # DDP averages gradients over processes; scale by the world size so the step's
        # gradient is Σ loss / n_global exactly.
        scale = acc.num_processes / max(n_global, 1)
        stats = torch.zeros(2, dtype=torch.float64, device=acc.device)  # [Σ loss, Σ α]
        for i, batch in enumerate(batches):
            sync = i == len(batches) - 1
            with acc.no_sync(self.draft) if not sync else nullcontext(), acc.autocast():
                loss_sum, alpha_sum = self.loss(batch)
                acc.backward(loss_sum * scale)
            stats[0] += loss_sum.detach().double()
            stats[1] += alpha_sum.double()
        grad_norm = acc.clip_grad_norm_(self.draft.parameters(), r.train.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        stats = acc.reduce(stats, "sum")
        denom = max(n_global, 1)
        return {
            "step": step + 1,
            "loss": stats[0].item() / denom,
            "alpha": stats[1].item() / denom,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm),
            "tokens": n_global,
        }

    def loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ loss over valid positions, detached Σ α at depth 0) for one micro-batch."""
        lo = self.recipe.loss
        if lo.chunk_size is None:
            d_logits, t_logits, masks = self.kind.depths(self.draft, self.target, batch)
            loss_sum, n_valid, alpha = losses.multi_depth_loss(
                lo.name,
                d_logits,
                t_logits,
                masks,
                weighting=lo.depth_weighting,
                decay=lo.depth_decay,
                temperature=lo.temperature,
                d2t=self.kind.d2t,
                **lo.params,
            )
            return loss_sum, alpha[0] * n_valid
        mask = target_mask(batch)
        # Chunked: logits exist one chunk of positions at a time, for both models.
        with torch.no_grad():
            t_hidden = shifted_hidden(self.target, batch)
        d_hidden = shifted_hidden(self.draft, batch)
        t_head, d_head = self.heads()
        loss_sum, _ = losses.chunked_loss(
            lo.name,
            d_hidden,
            d_head,
            (t_hidden, t_head),
            mask,
            chunk_size=lo.chunk_size,
            temperature=lo.temperature,
            **lo.params,
        )
        with torch.no_grad():
            alpha_sum = torch.zeros((), device=d_hidden.device)
            rows, t_rows = d_hidden[mask], t_hidden[mask]
            for start in range(0, rows.shape[0], lo.chunk_size):
                chunk = slice(start, start + lo.chunk_size)
                alpha_sum += losses.acceptance(
                    rows[chunk] @ d_head.T, t_rows[chunk] @ t_head.T, lo.temperature
                ).sum()
        return loss_sum, alpha_sum

    def heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Output-head weights [vocab_size, hidden] of target and draft, for chunked losses."""
        weights = []
        for role, model in (
            ("target", self.target),
            ("draft", self.accelerator.unwrap_model(self.draft)),
        ):
            head = model.get_output_embeddings()
            if head.bias is not None:
                raise RecipeError(
                    f"loss.chunk_size needs a bias-free output head; the {role}'s has a bias "
                    "(set loss.chunk_size=null)"
                )
            weights.append(head.weight[: self.vocab_size])
        return weights[0], weights[1]

    def evaluate(self) -> dict:
        acc, e = self.accelerator, self.recipe.eval
        self.draft.eval()
        sums = acceptance_sums(
            self.kind, self.target, self.draft, self.eval_batches(), temperature=e.temperature
        )
        self.draft.train()
        sums = acc.reduce(sums.to(acc.device), "sum").cpu()
        return summarise(sums, temperature=e.temperature, max_gamma=e.max_gamma)

    def speculative_eval(self) -> dict | None:
        """Real speculative decoding (eval/sweep.py) on held-out prompts, main process only:
        measured τ and speedup per γ next to the offline α. Other processes wait."""
        from specdistill.eval.sweep import Settings, sweep

        acc, s = self.accelerator, self.recipe.eval.speculative
        record = None
        if acc.is_main_process:
            n = min(s.prompts, len(self.eval_data))
            prompts = [self.eval_data[i]["input_ids"][: s.prompt_tokens].tolist() for i in range(n)]
            temperature = self.recipe.eval.temperature
            settings = Settings(
                gammas=list(s.gammas),
                temperatures=(temperature,),
                max_new_tokens=s.max_new_tokens,
                seed=self.recipe.train.seed,
            )
            result, _ = sweep(self.target, acc.unwrap_model(self.draft), prompts, settings)
            configs = {c["gamma"]: c for c in result["configs"]}
            best = result["best_gamma"][f"{temperature:g}"]["measured"]
            record = {"step": self.step, "spec/best_gamma": best}
            for g in s.gammas:
                record[f"spec/tau_{g}"] = configs[g]["tau"]
                record[f"spec/speedup_{g}"] = configs[g]["speedup"]
            self.log(record)
        acc.wait_for_everyone()
        return record

    # ----------------------------------------------------------------------------- state
    def checkpoints(self) -> list[Path]:
        return list_checkpoints(self.out)

    def save_checkpoint(self) -> None:
        """Written to a temporary folder, flushed to disk and renamed (publish_dir), so that
        neither a kill nor a crash of the machine leaves half a checkpoint under a step-* name.
        The size of metrics.jsonl goes with it: a resume cuts the log back to it."""
        acc = self.accelerator
        root = self.out / "checkpoints"
        name = f"{CHECKPOINT_PREFIX}{self.step:07d}"
        tmp = root / f".tmp-{name}"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        with quiet_tied_head_warning(acc.unwrap_model(self.draft)):
            acc.save_state(str(tmp), safe_serialization=True)
        acc.wait_for_everyone()
        if acc.is_main_process:
            metrics = self.out / "metrics.jsonl"
            state = {
                "step": self.step,
                "alpha_before": self.alpha_before,
                "history": self.history,
                "metrics_bytes": metrics.stat().st_size if metrics.exists() else 0,
            }
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
            dump_recipe(self.recipe, tmp / "recipe.yaml")
            publish_dir(tmp, root / name)
            for old in self.checkpoints()[: -self.recipe.train.keep_checkpoints]:
                shutil.rmtree(old)
        acc.wait_for_everyone()

    def resume(self) -> tuple[Path, dict] | None:
        """Load the newest checkpoint of the plan that loads: (its path, its trainer state), or
        None for a fresh start. A checkpoint that fails to load (a file cut short by a crash,
        a disk error) is named and the previous one is tried: losing a few steps beats
        losing the run, and saying so beats a bare safetensors error."""
        acc = self.accelerator
        failures = []
        for path in self.plan.resume_from:
            try:
                state = json.loads((path / STATE_FILE).read_text())
                acc.load_state(str(path))
            except Exception as e:  # whatever a damaged file raises: safetensors, pickle, JSON
                failures.append(f"{path} ({type(e).__name__}: {e})")
                acc.print(
                    f"warning: cannot load checkpoint {path} ({type(e).__name__}: {e}); "
                    "skipping it",
                    file=sys.stderr,
                )
                continue
            self.step = state["step"]
            self.alpha_before = restore_int_keys(state["alpha_before"])
            self.history = state["history"]
            if failures:
                acc.print(
                    f"warning: resuming from the previous complete checkpoint {path} instead",
                    file=sys.stderr,
                )
            acc.print(f"resumed from {path} at step {self.step}")
            harmless = recipe_changes(load_recipe(path / "recipe.yaml"), self.recipe)[1]
            if harmless:
                acc.print(
                    "recipe changes since that checkpoint (they do not alter the trained "
                    "draft): " + "; ".join(harmless)
                )
            return path, state
        if failures:
            raise CheckpointError(
                "no checkpoint could be loaded: "
                + "; ".join(failures)
                + ". Delete the damaged ones to resume from an earlier checkpoint, or pass "
                "train.overwrite=true to start over"
            )
        return None

    def _start_output_dir(self) -> None:
        """Carry out what prepare_output_dir decided (the first writes of the run): clear the
        directory for train.overwrite=true, delete what a kill left of an atomic publish."""
        acc = self.accelerator
        if acc.is_main_process:
            if self.plan.clear:
                acc.print(f"train.overwrite=true: deleting the contents of {self.out}")
                for entry in self.out.iterdir():
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry)
                    else:
                        entry.unlink()
            self.out.mkdir(parents=True, exist_ok=True)
            remove_leftovers(self.out)
        acc.wait_for_everyone()

    def _trim_metrics(self, resumed: tuple[Path, dict] | None) -> None:
        """Cut metrics.jsonl back to what it held when the resumed checkpoint was saved, so
        that the log of a killed and resumed run equals an uninterrupted run's: the steps
        between the checkpoint and the kill are trained, and logged, again."""
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return
        if resumed is None:  # resume=auto found no checkpoint: the log of a killed attempt
            self.accelerator.print(f"no checkpoint in {self.out}: starting the run afresh")
            path.unlink()
            return
        checkpoint, state = resumed
        size = state.get("metrics_bytes")
        ours = checkpoint.resolve().parent.parent == self.out.resolve()
        if size is not None and ours and path.stat().st_size >= size:
            os.truncate(path, size)
            return
        # A checkpoint without the size (an older one) or of another output_dir: by step.
        kept = []
        for line in path.read_text().splitlines(keepends=True):
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by the kill
            if step <= state["step"]:
                kept.append(line)
        atomic_write_text(path, "".join(kept))

    # ----------------------------------------------------------------------------- logging
    def log(self, record: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log(
                {k: v for k, v in record.items() if isinstance(v, int | float)}, step=record["step"]
            )

    def _start_wandb(self) -> None:
        w = self.recipe.wandb
        if w.project is None or w.mode == "disabled" or not self.accelerator.is_main_process:
            return
        import wandb

        self._wandb = wandb.init(
            project=w.project,
            entity=w.entity,
            name=w.name,
            mode=w.mode,
            dir=str(self.out),
            config=recipe_to_dict(self.recipe),
        )

    def _eval_record(self, metrics: dict) -> dict:
        record = {"step": self.step}
        for key, value in metrics.items():
            if key == "tau_pred":
                record.update({f"eval/tau_pred_{g}": t for g, t in value.items()})
            elif isinstance(value, list):  # per depth (eagle3): eval/alpha_depth_0, ...
                record.update({f"eval/{key}_{k}": v for k, v in enumerate(value)})
            else:
                record[f"eval/{key}"] = value
        return record

    # ----------------------------------------------------------------------------- run
    def run(self) -> dict:
        acc, r = self.accelerator, self.recipe
        if self.plan.finished is not None:
            return self._report_finished()
        self._start_output_dir()
        resumed = self.resume()
        if acc.is_main_process:
            self._trim_metrics(resumed)
            recipe_text = yaml.safe_dump(recipe_to_dict(r), sort_keys=False)
            atomic_write_text(self.out / "recipe.yaml", recipe_text)
        acc.wait_for_everyone()
        self._start_wandb()
        acc.print(
            f"target {r.target.model} | draft {r.draft.model} | loss {r.loss.name} | "
            f"{len(self.train_data)} train / {len(self.eval_data)} eval sequences | "
            f"{acc.num_processes} process(es) × {self.accum} accumulation step(s)"
        )
        skipped = {"train": self.train_data.stats.skipped, "eval": self.eval_data.stats.skipped}
        if any(skipped.values()) and resumed is None:  # a resumed log has it already
            self.log(
                {
                    "step": self.step,
                    "data/skipped": skipped["train"],
                    "data/skipped_eval": skipped["eval"],
                }
            )
        if self.alpha_before is None:
            self.alpha_before = self.evaluate()
            self.log(self._eval_record(self.alpha_before))
        acc.print(self._before_line(self.alpha_before["alpha"], self.alpha_before["alpha_greedy"]))
        # A progress bar only on a terminal; in a log file, plain lines every train.log_every.
        use_bar = acc.is_local_main_process and sys.stderr.isatty()
        bar = tqdm(
            total=r.train.max_steps,
            initial=self.step,
            disable=not use_bar,
            desc="distill",
            dynamic_ncols=True,
        )
        say = bar.write if use_bar else acc.print
        start = time.perf_counter()
        while self.step < r.train.max_steps:
            record = self.train_step(self.step)
            self.step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", alpha=f"{record['alpha']:.3f}")
            if self.step % r.train.log_every == 0 or self.step == r.train.max_steps:
                record["elapsed_s"] = time.perf_counter() - start
                self.log(record)
                if not use_bar:
                    acc.print(progress_line(record, r.train.max_steps))
            if r.eval.every and self.step % r.eval.every == 0 and self.step < r.train.max_steps:
                metrics = self.evaluate()
                self.history.append({"step": self.step, "alpha": metrics["alpha"]})
                self.log(self._eval_record(metrics))
                say(f"step {self.step}: held-out alpha {metrics['alpha']:.4f}")
            spec_every = r.eval.speculative.every
            if spec_every and self.step % spec_every == 0 and self.step < r.train.max_steps:
                self.speculative_eval()
            if r.train.save_every and self.step % r.train.save_every == 0:
                self.save_checkpoint()
        bar.close()
        final = self.evaluate()
        self.history.append({"step": self.step, "alpha": final["alpha"]})
        self.log(self._eval_record(final))
        if r.eval.speculative.every:
            spec = self.speculative_eval()
            if spec is not None:
                final["speculative"] = spec
        result = {
            **final,
            "alpha_before": self.alpha_before["alpha"],
            "alpha_greedy_before": self.alpha_before["alpha_greedy"],
            "tau_pred_before": self.alpha_before["tau_pred"],
            "steps": self.step,
            "loss": r.loss.name,
            "draft_type": r.draft.type,
            "trainable_params": trainable_parameters(self.draft),
            "history": self.history,
            "data_skipped": skipped,
        }
        self.save_final(result)
        acc.print(self._after_line(final, self.alpha_before["tau_pred"]))
        if self._wandb is not None:
            self._wandb.finish()
        acc.end_training()
        return result

    def save_final(self, result: dict) -> None:
        acc = self.accelerator
        acc.wait_for_everyone()
        if not acc.is_main_process:
            return
        draft = acc.unwrap_model(self.draft)
        if self.recipe.draft.lora.r > 0:
            draft = draft.merge_and_unload()
        # The verifier as serving engines can load it (an embedded target: its local directory).
        verifier = resolve_model(self.recipe.target.model)
        report = self.out / "eval.json"
        # eval.json marks the run complete (prepare_output_dir): it must never describe a
        # final/ other than the one beside it, so it goes first and comes back last.
        report.unlink(missing_ok=True)
        tmp = self.out / ".tmp-final"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with quiet_library_bars():
                self.kind.save(draft, tmp, self.tokenizer, verifier=verifier)
            publish_dir(tmp, self.out / "final")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        atomic_write_text(report, json.dumps(result, indent=1))

    def _before_line(self, alpha: float, greedy: float) -> str:
        return f"alpha before: {alpha:.4f} (T={self.recipe.eval.temperature}), greedy {greedy:.4f}"

    def _after_line(self, final: dict, tau_before: dict) -> str:
        nan = float("nan")
        return (
            f"alpha after:  {final['alpha']:.4f} (T={self.recipe.eval.temperature}), greedy "
            f"{final['alpha_greedy']:.4f} | tau_pred(gamma=5) {tau_before.get(5, nan):.3f} -> "
            f"{final['tau_pred'].get(5, nan):.3f} | outputs in {self.out}"
        )

    def _report_finished(self) -> dict:
        """A rerun of a complete run (train.resume=auto, e.g. the README command run twice):
        print the stored result and change nothing."""
        result = restore_int_keys(self.plan.finished)
        acc = self.accelerator
        acc.print(
            f"{self.out} already holds the finished run of this recipe ({result['steps']} "
            "steps): nothing to train. Pass train.max_steps=<more> to continue it, or "
            "train.overwrite=true to train it again."
        )
        acc.print(self._before_line(result["alpha_before"], result["alpha_greedy_before"]))
        acc.print(self._after_line(result, result["tau_pred_before"]))
        return result
