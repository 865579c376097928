"""The distillation loop: a frozen target, a trainable draft, an acceptance-optimising loss.

One optimiser step consumes `train.global_batch_size` sequences, split over processes and
micro-batches. The loss of a step is Σ(per-position loss) / (valid positions in the whole
global batch), so gradient accumulation and the number of processes do not change it.
The order of sequences is a function of (seed, step) alone, which makes a resumed run
replay exactly what an uninterrupted one would have seen.
"""

import json
import math
import shutil
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from specdistill import losses
from specdistill.data import build_datasets, collate
from specdistill.drafts.align import shifted_hidden, target_mask
from specdistill.eval.offline import acceptance_sums, summarise
from specdistill import drafts
from specdistill.train import models
from specdistill.train.config import Recipe, RecipeError, dump_recipe, recipe_to_dict
from specdistill.drafts.eagle3_head import Eagle3Head, is_eagle3_dir
from specdistill.train.embedded import resolve_model

CHECKPOINT_PREFIX = "step-"


def trainable_parameters(module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        r = recipe
        # cpu=True without a GPU: processes started by torchrun / `accelerate launch --multi_gpu`
        # then form a gloo group (accelerate only does that when told it is on the CPU).
        self.accelerator = Accelerator(
            mixed_precision=r.train.mixed_precision, cpu=not torch.cuda.is_available()
        )
        acc = self.accelerator
        set_seed(r.train.seed)
        self.out = Path(r.train.output_dir)
        world = acc.num_processes
        per_step = r.train.micro_batch_size * world
        if r.train.global_batch_size % per_step:
            raise RecipeError(
                f"train.global_batch_size ({r.train.global_batch_size}) must be a multiple of "
                f"train.micro_batch_size × processes ({r.train.micro_batch_size} × {world})"
            )
        self.accum = r.train.global_batch_size // per_step

        # Only the main process builds an embedded model; the others wait, then load it.
        with acc.main_process_first():
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

        self.step = 0
        self.alpha_before: dict | None = None
        self.history: list[dict] = []
        self._perms: dict[int, torch.Tensor] = {}
        self._wandb = None

    def _eagle3_head(self):
        d = self.recipe.draft
        if d.model is None:
            head = drafts.eagle3.new_eagle3_head(self.target, d, self.train_data, self.vocab_size)
        elif is_eagle3_dir(d.model):
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
        """Real speculative decoding (eval/speculative.py) on held-out prompts, main process only:
        measured τ and speedup per γ next to the offline α. Other processes wait."""
        from specdistill.eval.speculative import quick_eval

        acc, s = self.accelerator, self.recipe.eval.speculative
        record = None
        if acc.is_main_process:
            n = min(s.prompts, len(self.eval_data))
            prompts = [self.eval_data[i]["input_ids"][: s.prompt_tokens].tolist() for i in range(n)]
            result = quick_eval(
                self.target,
                acc.unwrap_model(self.draft),
                prompts,
                gammas=s.gammas,
                temperature=self.recipe.eval.temperature,
                max_new_tokens=s.max_new_tokens,
                seed=self.recipe.train.seed,
            )
            record = {"step": self.step, "spec/best_gamma": result["best_gamma"]}
            for g in s.gammas:
                record[f"spec/tau_{g}"] = result["tau"][g]
                record[f"spec/speedup_{g}"] = result["speedup"][g]
            self.log(record)
        acc.wait_for_everyone()
        return record

    # ----------------------------------------------------------------------------- state
    def checkpoints(self) -> list[Path]:
        root = self.out / "checkpoints"
        if not root.is_dir():
            return []
        done = [
            p for p in root.glob(f"{CHECKPOINT_PREFIX}*") if (p / "trainer_state.json").is_file()
        ]
        return sorted(done, key=lambda p: int(p.name.removeprefix(CHECKPOINT_PREFIX)))

    def save_checkpoint(self) -> None:
        """Written to a temporary folder and renamed, so a kill never leaves half a checkpoint."""
        acc = self.accelerator
        root = self.out / "checkpoints"
        final = root / f"{CHECKPOINT_PREFIX}{self.step:07d}"
        tmp = root / f".tmp-{CHECKPOINT_PREFIX}{self.step:07d}"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp), safe_serialization=True)
        acc.wait_for_everyone()
        if acc.is_main_process:
            state = {"step": self.step, "alpha_before": self.alpha_before, "history": self.history}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
            dump_recipe(self.recipe, tmp / "recipe.yaml")
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for old in self.checkpoints()[: -self.recipe.train.keep_checkpoints]:
                shutil.rmtree(old)
        acc.wait_for_everyone()

    def resume(self) -> None:
        spec = self.recipe.train.resume
        if spec == "no":
            return
        if spec == "auto":
            found = self.checkpoints()
            if not found:
                self.accelerator.print(f"resume=auto: no checkpoint in {self.out}, starting fresh")
                return
            path = found[-1]
        else:
            path = Path(spec)
            if not (path / "trainer_state.json").is_file():
                raise RecipeError(f"train.resume: {path} is not a checkpoint directory")
        self.accelerator.load_state(str(path))
        state = json.loads((path / "trainer_state.json").read_text())
        self.step = state["step"]
        self.alpha_before = state["alpha_before"]
        self.history = state["history"]
        self.accelerator.print(f"resumed from {path} at step {self.step}")

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
        if acc.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
            dump_recipe(r, self.out / "recipe.yaml")
        acc.wait_for_everyone()
        self.resume()
        self._start_wandb()
        acc.print(
            f"target {r.target.model} | draft {r.draft.model} | loss {r.loss.name} | "
            f"{len(self.train_data)} train / {len(self.eval_data)} eval sequences | "
            f"{acc.num_processes} process(es) × {self.accum} accumulation step(s)"
        )
        if self.alpha_before is None:
            self.alpha_before = self.evaluate()
            self.log(self._eval_record(self.alpha_before))
        acc.print(
            f"alpha before: {self.alpha_before['alpha']:.4f} (T={r.eval.temperature}), "
            f"greedy {self.alpha_before['alpha_greedy']:.4f}"
        )
        bar = tqdm(
            total=r.train.max_steps,
            initial=self.step,
            disable=not acc.is_local_main_process,
            desc="distill",
            dynamic_ncols=True,
        )
        start = time.perf_counter()
        while self.step < r.train.max_steps:
            record = self.train_step(self.step)
            self.step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", alpha=f"{record['alpha']:.3f}")
            if self.step % r.train.log_every == 0 or self.step == r.train.max_steps:
                record["elapsed_s"] = time.perf_counter() - start
                self.log(record)
            if r.eval.every and self.step % r.eval.every == 0 and self.step < r.train.max_steps:
                metrics = self.evaluate()
                self.history.append({"step": self.step, "alpha": metrics["alpha"]})
                self.log(self._eval_record(metrics))
                bar.write(f"step {self.step}: held-out alpha {metrics['alpha']:.4f}")
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
        }
        self.save_final(result)
        acc.print(
            f"alpha after:  {final['alpha']:.4f} (T={r.eval.temperature}), greedy "
            f"{final['alpha_greedy']:.4f} | tau_pred(gamma=5) "
            f"{self.alpha_before['tau_pred'].get(5, float('nan')):.3f} -> "
            f"{final['tau_pred'].get(5, float('nan')):.3f} | outputs in {self.out}"
        )
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
        final = self.out / "final"
        # The verifier as serving engines can load it (an embedded target: its local directory).
        verifier = resolve_model(self.recipe.target.model)
        self.kind.save(draft, final, self.tokenizer, verifier=verifier)
        (self.out / "eval.json").write_text(json.dumps(result, indent=1))
