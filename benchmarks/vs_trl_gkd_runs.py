"""The runs of benchmarks/vs_trl_gkd.py, each in its own subprocess (`RUNNERS`, by the
name in its spec): specdistill's `Trainer`, TRL's `GKDTrainer` on the same sequences in the
same order, and the initial draft's held-out α. Each returns its loop's wall and CPU seconds,
peak memory (`Meter`), held-out α, token counts and first and last loss; vs_trl_gkd.py's
docstring says what is held equal.
"""

import os
import time

import torch

from benchmarks.loss_memory import _reset_peak, _status_kib


# ------------------------------------------------------------------------------- data
def sequence_order(n: int, seed: int, count: int) -> list[int]:
    """The dataset indices of the first `count` training sequences, as `Trainer` draws them
    (Trainer._permutation / micro_batches): one seeded permutation per epoch."""
    perms = {}
    out = []
    for i in range(count):
        epoch = i // n
        if epoch not in perms:
            g = torch.Generator().manual_seed(seed * 100_003 + epoch)
            perms[epoch] = torch.randperm(n, generator=g)
        out.append(int(perms[epoch][i % n]))
    return out


# ------------------------------------------------------------------------------- memory
class Meter:
    """Wall and CPU seconds of the training loop, the RSS when it starts, and the peaks."""

    def start(self) -> None:
        self.load_peak = _status_kib("VmHWM") * 1024  # loading, before the loop
        self.rss_start = _reset_peak("cpu")  # VmHWM := VmRSS
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def stop(self) -> dict:
        seconds, cpu = time.perf_counter() - self.t0, time.process_time() - self.c0
        train_peak = _status_kib("VmHWM") * 1024
        return {
            "seconds": seconds,
            "cpu_seconds": cpu,
            "peak_rss": max(self.load_peak, train_peak),
            "train_peak_extra": train_peak - self.rss_start,
            "rss_start": self.rss_start,
        }


# ------------------------------------------------------------------------------- runs
def held_out_alpha(target, draft, eval_data, pad_id: int, vocab_size: int, spec: dict) -> dict:
    """Held-out α at T=1 and greedy α of `draft` on the first spec["eval_sequences"] held-out
    sequences, eval/offline.py's acceptance_sums."""
    from specdistill.data import collate
    from specdistill.drafts.standalone import Standalone
    from specdistill.eval.offline import acceptance_sums, summarise

    draft.eval()
    n, batch = min(spec["eval_sequences"], len(eval_data)), spec["eval_batch"]
    batches = [
        collate([eval_data[i] for i in range(s, min(s + batch, n))], pad_id)
        for s in range(0, n, batch)
    ]
    sums = acceptance_sums(Standalone(vocab_size), target, draft, batches, temperature=1.0)
    metrics = summarise(sums, temperature=1.0, max_gamma=5)
    return {"alpha": metrics["alpha"], "alpha_greedy": metrics["alpha_greedy"]}


def _recipe(spec: dict):
    from specdistill.train.config import load_recipe

    return load_recipe(spec["recipe"], spec["overrides"])


def _tokens(train_data, order: list[int]) -> tuple[int, int]:
    """(non-padding tokens, loss tokens) of the sequences at `order`."""
    from specdistill.drafts.align import target_mask

    tokens = loss = 0
    for i in order:
        item = train_data[i]
        tokens += len(item["input_ids"])
        batch = {k: v[None] for k, v in item.items()}
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        loss += int(target_mask(batch).sum())
    return tokens, loss


def run_specdistill(spec: dict) -> dict:
    from specdistill.data import collate
    from specdistill.train.trainer import Trainer

    recipe = _recipe(spec)
    steps, g = recipe.train.max_steps, recipe.train.global_batch_size
    trainer = Trainer.from_recipe(recipe)
    order = sequence_order(len(trainer.train_data), recipe.train.seed, steps * g)
    pad = trainer.tokenizer.pad_token_id
    first = collate([trainer.train_data[i] for i in order[: recipe.train.micro_batch_size]], pad)
    assert torch.equal(trainer.micro_batches(0)[0]["input_ids"], first["input_ids"]), "order"
    meter = Meter()
    meter.start()
    losses = [trainer.train_step(step)["loss"] for step in range(steps)]
    result = meter.stop()
    draft = trainer.accelerator.unwrap_model(trainer.draft)
    result["alpha"] = held_out_alpha(
        trainer.target,
        draft,
        trainer.eval_data,
        trainer.tokenizer.pad_token_id,
        trainer.vocab_size,
        spec,
    )
    result["tokens"], result["loss_tokens"] = _tokens(trainer.train_data, order)
    result["losses"] = [losses[0], losses[-1]]
    return result


def run_trl(spec: dict) -> dict:
    import warnings

    from transformers.utils import logging as hf_logging

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd import GKDTrainer

    from specdistill.models import hub
    from specdistill.train.config import recipe_datasets

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    r = _recipe(spec)
    t = r.train
    torch.manual_seed(t.seed)
    tokenizer = hub.load_tokenizer(r.target.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    target = hub.load_model(r.target.model, dtype=r.target.dtype)
    draft = hub.load_model(r.draft.model, dtype=r.draft.dtype)
    vocab_size = hub.shared_vocab_size(target, draft, tokenizer)
    train_data, eval_data = recipe_datasets(r, tokenizer)
    order = sequence_order(len(train_data), t.seed, t.max_steps * t.global_batch_size)
    meter = Meter()
    losses = []
    trainer = GKDTrainer(
        model=draft,
        teacher_model=target,
        args=_gkd_config(spec, r),
        data_collator=_label_collator(tokenizer.pad_token_id),
        train_dataset=_trl_sequences(train_data, order),
        processing_class=tokenizer,
        optimizers=_optimizer(draft, t),
        callbacks=[_clock(meter, losses)],
    )
    trainer.train()
    result = meter.result
    result["alpha"] = held_out_alpha(
        target,
        trainer.accelerator.unwrap_model(trainer.model),
        eval_data,
        tokenizer.pad_token_id,
        vocab_size,
        spec,
    )
    result["tokens"], result["loss_tokens"] = _tokens(train_data, order)
    result["losses"] = [losses[0], losses[-1]]
    return result


def _trl_sequences(train_data, order: list[int]):
    """The sequences at `order`, in that order, as the `datasets.Dataset` TRL reads."""
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "input_ids": [train_data[i]["input_ids"].tolist() for i in order],
            "loss_mask": [train_data[i]["loss_mask"].tolist() for i in order],
        }
    )


def _label_collator(pad_id: int):
    """TRL's data collator: specdistill's collate, the tokens outside the loss mask (and
    the padding) labelled -100."""
    from specdistill.data import collate

    def collate_labels(rows: list[dict]) -> dict:
        items = [
            {
                "input_ids": torch.tensor(row["input_ids"]),
                "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.bool),
            }
            for row in rows
        ]
        batch = collate(items, pad_id)
        keep = batch["loss_mask"] & batch["attention_mask"].bool()
        labels = batch["input_ids"].masked_fill(~keep, -100)
        return {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "labels": labels,
        }

    return collate_labels


def _optimizer(draft, t) -> tuple:
    """(AdamW, the recipe's warmup + cosine schedule) as `Trainer` builds them, for TRL's
    `optimizers=`; `t`: the recipe's `train` section."""
    from specdistill.train.trainer import lr_lambda

    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, t.warmup_steps, t.max_steps, t.min_lr_ratio)
    )
    return optimizer, scheduler


def _clock(meter: Meter, losses: list):
    """A TRL callback that runs `meter` over the training loop (its result in
    `meter.result`) and appends each logged loss to `losses`."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            meter.start()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

        def on_train_end(self, args, state, control, **kwargs):
            meter.result = meter.stop()

    return Clock()


def _gkd_config(spec: dict, r):
    """TRL's GKD settings for the recipe `r`: forward KL on the data (lmbda = beta = 0),
    the recipe's batch sizes, steps and clipping, sequences in order, fp32 unless
    spec["trl_defaults"]."""
    from trl.experimental.gkd import GKDConfig

    t = r.train
    return GKDConfig(
        output_dir=spec["scratch"],
        lmbda=0.0,
        beta=0.0,
        temperature=r.loss.temperature,
        max_length=r.data.max_length,
        max_steps=t.max_steps,
        per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.global_batch_size // t.micro_batch_size,
        max_grad_norm=t.max_grad_norm,
        train_sampling_strategy="sequential",
        # TRL's own defaults are bf16 autocast and gradient checkpointing; off unless the
        # row measures them, so that both trainers compute the same thing.
        bf16=spec.get("trl_defaults", False),
        gradient_checkpointing=spec.get("trl_defaults", False),
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=t.seed,
    )


def run_before(spec: dict) -> dict:
    """Held-out α of the initial draft."""
    from specdistill.models import hub
    from specdistill.train.config import recipe_datasets

    r = _recipe(spec)
    tokenizer = hub.load_tokenizer(r.target.model)
    target = hub.load_model(r.target.model, dtype=r.target.dtype)
    draft = hub.load_model(r.draft.model, dtype=r.draft.dtype)
    _, eval_data = recipe_datasets(r, tokenizer)
    vocab_size = hub.shared_vocab_size(target, draft, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return {"alpha": held_out_alpha(target, draft, eval_data, pad, vocab_size, spec)}


RUNNERS = {
    "specdistill": run_specdistill,
    "trl": run_trl,
    "trl-defaults": lambda spec: run_trl({**spec, "trl_defaults": True}),
    "before": run_before,
}
