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

import copy
import json
import math
import os
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from specdistill import drafts, losses
from specdistill.data import collate
from specdistill.drafts import hub as models
from specdistill.drafts.align import shifted_hidden, target_mask
from specdistill.drafts.embedded import resolve_model
from specdistill.eval.offline import acceptance_sums, held_out_texts, summarise, tau_rounds_pred
from specdistill.publish import atomic_write_text, publish_dir
from specdistill.train.config import (
    Recipe,
    RecipeError,
    dump_recipe,
    load_recipe,
    recipe_datasets,
    recipe_to_dict,
)
from specdistill.train.distributed import (
    check_layout,
    full_head_weight,
    is_sharded,
    layout,
    load_full,
    make_accelerator,
    meta_copy,
    prepare_sharded_draft,
)
from specdistill.train.rundir import (
    CHECKPOINT_PREFIX,
    STATE_FILE,
    CheckpointError,
    RunPlan,
    check_checkpoint_weights,
    list_checkpoints,
    prepare_output_dir,
    progress_line,
    quiet_library_bars,
    quiet_tied_head_warning,
    recipe_changes,
    remove_leftovers,
    restore_int_keys,
)


def trainable_parameters(module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    """Trains `draft` against the frozen `target` as `recipe` says, writing into its output_dir.

    Built from parts (tests and benchmarks hand in their own models, data or accelerator);
    `Trainer.from_recipe(recipe)` does the usual wiring: validate the output_dir, start
    accelerate, load the target, the data and the draft.
    """

    def __init__(
        self,
        recipe: Recipe,
        *,
        accelerator: Accelerator,
        plan: RunPlan,
        target=None,
        draft=None,
        kind=None,
        tokenizer=None,
        train_data=None,
        eval_data=None,
        cache=None,
    ):
        """target, draft (a module, not yet prepared), kind (its draft type, drafts/),
        tokenizer and the datasets may be None only when `plan` is a finished run."""
        self.recipe = r = recipe
        self.plan, self.out = plan, plan.out
        self.accelerator = acc = accelerator
        self.step = 0
        self.alpha_before: dict | None = None
        self.history: list[dict] = []
        # The held-out-α-best evaluation so far ({"step", "alpha", ...}); its draft is best/.
        self.best: dict | None = None
        self._perms: dict[int, torch.Tensor] = {}
        self._wandb = None
        self._tau_texts: tuple[list, list] | None = None  # (prompts, target's outputs)
        self.cache = (
            cache  # a train.target_cache.TargetCache (target.cache), or None: the live target
        )
        self.on_policy = None  # a train.on_policy.OnPolicy with data.on_policy.fraction > 0
        if plan.finished is not None:
            return  # nothing to train: run() reports the stored result
        world = acc.num_processes
        per_step = r.train.micro_batch_size * world
        if r.train.global_batch_size % per_step:
            raise RecipeError(
                f"train.global_batch_size ({r.train.global_batch_size}) must be a multiple of "
                f"train.micro_batch_size × processes ({r.train.micro_batch_size} × {world})"
            )
        self.accum = r.train.global_batch_size // per_step
        check_layout(acc, self.accum, r.train.max_grad_norm, r.loss.chunk_size)
        self.tokenizer, self.kind = tokenizer, kind
        self.vocab_size = kind.vocab_size
        self.train_data, self.eval_data = train_data, eval_data
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # The frozen target: never trained, never handed to accelerate (so never wrapped or
        # sharded); every process holds a whole copy in target.dtype (train/distributed.py).
        self.target = target.eval().requires_grad_(False).to(acc.device)
        # A sharded draft (FSDP, ZeRO-3) is gathered into this frame on the main process to
        # be saved or decoded alone (`full_draft`); parameters on the meta device cost nothing.
        self._frame = meta_copy(draft) if is_sharded(acc) and acc.is_main_process else None
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
        prepare_sharded_draft(acc, self.draft)
        acc.register_for_checkpointing(self.scheduler)
        self.on_policy = self._on_policy() if r.data.on_policy.fraction > 0 else None

    @classmethod
    def from_recipe(cls, recipe: Recipe, accelerator: Accelerator | None = None) -> "Trainer":
        """The whole wiring of a run from its recipe. The output_dir is validated before any
        model loads, so that a run that cannot go on fails in seconds and writes nothing."""
        r = recipe
        plan = prepare_output_dir(recipe)
        # Without a GPU: a gloo group, DDP or (an FSDP launch) FSDP2 (train/distributed.py).
        acc = accelerator or make_accelerator(r.train.mixed_precision)
        set_seed(r.train.seed)
        if plan.finished is not None:
            return cls(recipe, accelerator=acc, plan=plan)
        # Only the main process builds an embedded model; the others wait, then load it.
        with acc.main_process_first(), quiet_library_bars():
            tokenizer = models.load_tokenizer(r.target.model, r.target.revision)
            target = models.load_target(
                r.target.model, r.target.adapter, dtype=r.target.dtype, revision=r.target.revision
            )
            train_data, eval_data = recipe_datasets(r, tokenizer)
            try:
                draft, kind = drafts.build(r.draft, target, tokenizer, train_data, print=acc.print)
            except models.TokenizerMismatchError:
                raise
            except ValueError as e:  # a draft that does not fit this target or recipe
                raise RecipeError(str(e)) from None
            cache = None
            if r.target.cache is not None:  # checked against this run before any training
                from specdistill.train.target_cache import CacheError, open_cache

                try:
                    cache = open_cache(
                        r,
                        tokenizer=tokenizer,
                        target=target,
                        train_data=train_data,
                        vocab_size=kind.vocab_size,
                    )
                except CacheError as e:
                    raise RecipeError(str(e)) from None
        return cls(
            recipe,
            accelerator=acc,
            plan=plan,
            target=target,
            draft=draft,
            kind=kind,
            tokenizer=tokenizer,
            train_data=train_data,
            eval_data=eval_data,
            cache=cache,
        )

    # ----------------------------------------------------------------------------- data
    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.recipe.train.seed * 100_003 + epoch)
            self._perms = {epoch: torch.randperm(len(self.train_data), generator=g)}
        return self._perms[epoch]

    def _on_policy(self):
        """The generator of data.on_policy rows (train/on_policy.py). A sharded draft cannot
        write alone: source=draft is refused there, source=target decodes with the target."""
        from specdistill.train.on_policy import OnPolicy

        acc, source = self.accelerator, self.recipe.data.on_policy.source
        if is_sharded(acc) and source == "draft":
            raise RecipeError(
                f"data.on_policy.source=draft is not supported with a sharded draft "
                f"({layout(acc)}): use data.on_policy.source=target or a replicated layout"
            )
        return OnPolicy(
            self.recipe,
            target=self.target,
            draft=None if is_sharded(acc) else acc.unwrap_model(self.draft),
            tokenizer=self.tokenizer,
            vocab_size=self.vocab_size,
            device=acc.device,
        )

    def micro_batches(self, step: int) -> list[dict]:
        """This process's micro-batches for optimiser step `step` (a pure function of step, and
        with data.on_policy of the draft's weights at that step)."""
        g = self.recipe.train.global_batch_size
        n = len(self.train_data)
        indices = [int(self._permutation(i // n)[i % n]) for i in range(step * g, (step + 1) * g)]
        acc = self.accelerator
        share = g // acc.num_processes
        mine = indices[acc.process_index * share : (acc.process_index + 1) * share]
        mb = self.recipe.train.micro_batch_size
        batches = [self._collate(self.train_data, mine[i : i + mb]) for i in range(0, share, mb)]
        if self.on_policy is not None:  # some rows generated now (train/on_policy.py)
            if self.cache is not None:  # online's sparse targets, say: no rows for new text
                raise RecipeError("data.on_policy needs the live target: set fraction=0")
            first = acc.process_index * share
            batches = [self.on_policy.batch(step, first + i * mb, b) for i, b in enumerate(batches)]
        if self.cache is not None:  # the cache is looked up by dataset index
            for k, batch in enumerate(batches):
                batch["sequence"] = torch.tensor(mine[k * mb : (k + 1) * mb])
        return batches

    def _collate(self, dataset, indices: list[int]) -> dict:
        batch = collate([dataset[i] for i in indices], self.tokenizer.pad_token_id)
        return {k: v.to(self.accelerator.device) for k, v in batch.items()}

    def eval_batches(self) -> list[dict]:
        """This process's share of the held-out sequences, in micro-batches. Every process
        gets the same number of batches (a sharded draft's forward is collective): those
        short of the most are topped up with a copy of sequence 0 whose loss_mask is all
        False, which adds nothing to the sums."""
        acc = self.accelerator
        n = min(len(self.eval_data), self.recipe.eval.max_sequences)
        mine = list(range(acc.process_index, n, acc.num_processes))
        mb = self.recipe.train.micro_batch_size
        batches = [self._collate(self.eval_data, mine[i : i + mb]) for i in range(0, len(mine), mb)]
        most = math.ceil(math.ceil(n / acc.num_processes) / mb)
        while len(batches) < most:
            filler = self._collate(self.eval_data, [0])
            filler["loss_mask"] = torch.zeros_like(filler["loss_mask"])
            batches.append(filler)
        return batches

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
        record = {
            "step": step + 1,
            "loss": stats[0].item() / denom,
            "alpha": stats[1].item() / denom,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm),
            "tokens": n_global,
        }
        if self.on_policy is not None:  # the generation's cost, apart from training's
            record.update(self.on_policy.take_metrics(acc))
        return record

    def loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ loss over valid positions, detached Σ α at depth 0) for one micro-batch."""
        lo = self.recipe.loss
        if lo.chunk_size is None:
            if self.cache is not None:  # the target's cached top-N (train/target_cache.py)
                d_logits, t_logits, masks = self.cache.depths(self.draft, batch, self.vocab_size)
            else:
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
        loss_sum, _, alpha_sum = losses.chunked_loss(
            lo.name,
            d_hidden,
            d_head,
            (t_hidden, t_head),
            mask,
            chunk_size=lo.chunk_size,
            temperature=lo.temperature,
            return_alpha=True,  # from the chunks the loss computes: no second pass
            **lo.params,
        )
        return loss_sum, alpha_sum

    def heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Output-head weights [vocab_size, hidden] of target and draft, for chunked losses.
        The draft's is its whole, trained parameter also when FSDP shards the draft
        (train/distributed.py `full_head_weight`)."""
        weights = []
        for role, model in (
            ("target", self.target),
            ("draft", self.accelerator.unwrap_model(self.draft)),
        ):
            head = model.get_output_embeddings()
            if hasattr(head, "base_layer"):  # a peft LoRA layer: .weight misses its delta
                raise RecipeError(
                    f"loss.chunk_size cannot use the {role}'s output head: a LoRA adapter "
                    "wraps it (set loss.chunk_size=null)"
                )
            if head.bias is not None:
                raise RecipeError(
                    f"loss.chunk_size needs a bias-free output head; the {role}'s has a bias "
                    "(set loss.chunk_size=null)"
                )
            weight = head.weight if role == "target" else full_head_weight(head)
            weights.append(weight[: self.vocab_size])
        return weights[0], weights[1]

    def evaluate(self) -> dict:
        acc, e = self.accelerator, self.recipe.eval
        self.draft.eval()
        sums = acceptance_sums(
            self.kind, self.target, self.draft, self.eval_batches(), temperature=e.temperature
        )
        tau = None
        if e.tau_prompts > 0:
            prompts, outputs = self.tau_texts()
            tau = tau_rounds_pred(
                self.target,
                acc.unwrap_model(self.draft),
                prompts,
                outputs,
                temperature=e.temperature,
                max_gamma=e.max_gamma,
            )
        self.draft.train()
        sums = acc.reduce(sums.to(acc.device), "sum").cpu()
        return summarise(sums, temperature=e.temperature, max_gamma=e.max_gamma, tau_rounds=tau)

    TAU_TEXTS = "tau_texts.json"

    def tau_texts(self) -> tuple[list[list[int]], list[list[int]]]:
        """The target's continuations of the first eval.tau_prompts held-out sequences (cut
        to eval.tau_prompt_tokens), eval.tau_tokens each, at eval.temperature: generated once
        per run, kept in memory and in OUT/tau_texts.json for a resumed run. Every process
        computes the same texts (one seed); the main process writes the file."""
        if self._tau_texts is not None:
            return self._tau_texts
        e = self.recipe.eval
        n = min(e.tau_prompts, len(self.eval_data))
        prompts = [self.eval_data[i]["input_ids"][: e.tau_prompt_tokens].tolist() for i in range(n)]
        settings = {
            "target": recipe_to_dict(self.recipe)["target"],
            "temperature": e.temperature,
            "tau_tokens": e.tau_tokens,
            "seed": self.recipe.train.seed,
        }
        settings = json.loads(json.dumps(settings))  # as it reads back from the file
        path = self.out / self.TAU_TEXTS
        stored = json.loads(path.read_text()) if path.is_file() else None
        if stored and stored.get("settings") == settings and stored.get("prompts") == prompts:
            outputs = stored["outputs"]
        else:
            outputs = held_out_texts(
                self.target,
                prompts,
                temperature=e.temperature,
                max_new_tokens=e.tau_tokens,
                seed=self.recipe.train.seed,
            )
            if self.accelerator.is_main_process:
                record = {"settings": settings, "prompts": prompts, "outputs": outputs}
                atomic_write_text(path, json.dumps(record))
        self._tau_texts = (prompts, outputs)
        return self._tau_texts

    def speculative_eval(self) -> dict | None:
        """Real speculative decoding (eval/sweep.py) on held-out prompts, main process only:
        measured τ and speedup per γ next to the offline α. Other processes wait (a sharded
        draft is first gathered into a whole copy on the main process, with every process
        taking part, so that the main process decodes alone)."""
        from specdistill.eval.sweep import Settings, sweep

        acc, s = self.accelerator, self.recipe.eval.speculative
        record = None
        draft = self.full_draft()
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
            result, _ = sweep(self.target, draft, prompts, settings)
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
                "best": self.best,
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
        a disk error, weights that do not match the draft: `check_checkpoint_weights` names
        the tensors) is named and the previous one is tried: losing a few steps beats
        losing the run, and saying so beats a bare safetensors error."""
        acc = self.accelerator
        failures = []
        for path in self.plan.resume_from:
            try:
                state = json.loads((path / STATE_FILE).read_text())
                check_checkpoint_weights(path, self.draft)  # all or nothing, names the tensors
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
            self.best = restore_int_keys(state["best"]) if state.get("best") else None
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
            if key.startswith("tau_pred") and isinstance(value, dict):  # tau_pred, tau_pred_iid
                record.update({f"eval/{key}_{g}": t for g, t in value.items()})
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
            f"{acc.num_processes} process(es) ({layout(acc)}) × {self.accum} accumulation step(s)"
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
                self.keep_best(metrics)
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
        final_is_best = self.best is None or final["alpha"] > self.best["alpha"]
        if final_is_best:
            self.best = self._best_record({**final, "step": self.step})
        result["best"] = self.best
        self.save_final(result, copy_to_best=final_is_best)
        acc.print(self._after_line(result, self.alpha_before["tau_pred"]))
        if self._wandb is not None:
            self._wandb.finish()
        acc.end_training()
        return result

    def full_draft(self):
        """The trained draft as one plain module on the main process, None on the others;
        every process must call it. Replicated (one process, DDP, ZeRO-1/2): the unwrapped
        draft itself. Sharded (FSDP, ZeRO-3): a copy holding the full weights, gathered with
        `Accelerator.get_state_dict`, in which every process takes part."""
        acc = self.accelerator
        if not is_sharded(acc):
            return acc.unwrap_model(self.draft) if acc.is_main_process else None
        state = acc.get_state_dict(self.draft)
        if not acc.is_main_process:
            return None
        return load_full(self._frame, state, acc.device)

    @staticmethod
    def _best_record(metrics: dict) -> dict:
        keys = ("step", "alpha", "alpha_greedy", "tau_pred")
        return {k: metrics[k] for k in keys if k in metrics}

    def keep_best(self, metrics: dict) -> None:
        """After a periodic held-out evaluation: when its α beats every earlier one, publish
        the draft as best/ (checkpoints are chosen by α, not by loss). Every process calls it:
        a sharded draft is gathered."""
        if self.best is not None and metrics["alpha"] <= self.best["alpha"]:
            return
        self.best = self._best_record({**metrics, "step": self.step})
        draft = self.full_draft()
        if self.accelerator.is_main_process:
            self.publish_draft(draft, self.out / "best", merged_copy=True)
        self.accelerator.wait_for_everyone()

    def publish_draft(self, draft, dest: Path, *, merged_copy: bool = False) -> None:
        """Save `draft` in its serving format at `dest`, atomically (publish_dir). A LoRA
        draft is saved merged; `merged_copy` merges a copy, leaving the trained one as it is."""
        if self.recipe.draft.lora.r > 0:
            draft = (copy.deepcopy(draft) if merged_copy else draft).merge_and_unload()
        # The verifier as serving engines can load it (an embedded target: its local directory).
        verifier = resolve_model(self.recipe.target.model)
        tmp = self.out / f".tmp-{dest.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with quiet_library_bars():
                self.kind.save(draft, tmp, self.tokenizer, verifier=verifier)
            publish_dir(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def save_final(self, result: dict, *, copy_to_best: bool = False) -> None:
        """final/ (and best/ too when the final evaluation is the best), then eval.json."""
        acc = self.accelerator
        acc.wait_for_everyone()
        draft = self.full_draft()  # every process: a sharded draft is gathered
        if not acc.is_main_process:
            return
        report = self.out / "eval.json"
        # eval.json marks the run complete (prepare_output_dir): it must never describe a
        # final/ other than the one beside it, so it goes first and comes back last.
        report.unlink(missing_ok=True)
        self.publish_draft(draft, self.out / "final")
        if copy_to_best:  # the same files: copied, not serialised (and merged) a second time
            tmp = self.out / ".tmp-best"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                shutil.copytree(self.out / "final", tmp)
                publish_dir(tmp, self.out / "best")
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
        ) + (
            f"\nbest held-out alpha {best['alpha']:.4f} at step {best['step']}: {self.out}/best"
            if (best := final.get("best")) and best["step"] != final.get("steps")
            else ""
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
