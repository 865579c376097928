"""A peft LoRA fine-tune of a target: on a mixture of texts (`finetune_adapter`) or a
supervised fine-tune on chat records, the loss on the assistant's tokens only (`sft_adapter`).

The fine-tuned targets of the demos and benchmarks: `benchmarks/drift_demo.py` (a target
fine-tuned on prose, to measure α drift), `benchmarks/real_drift.py` (SFTs of a real
instruction model that change its answers' style) and `specdistill online demo --shift
target` (a served target that knows a domain its draft was never fit on). The adapter is
saved unmerged; `models.hub.load_target` loads it on top of the base (docs/drift.md).
`merge_adapter` writes the merged target as well, as users also ship one.
"""

from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdistill.data.dataset import build_datasets, collate
from specdistill.errors import UserError
from specdistill.models import hub

LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IGNORE = -100  # labels the loss skips


def token_blocks(tokenizer, texts: list[str], seq: int) -> torch.Tensor:
    """The texts tokenized, joined with EOS and cut into rows of `seq` ids (the tail dropped)."""
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    if len(ids) < seq:
        raise UserError(f"{len(ids)} tokens in all: too few for one row of {seq}")
    return torch.tensor(ids[: len(ids) // seq * seq]).view(-1, seq)


def finetune_adapter(
    base: str,
    out: Path,
    sources: list[tuple[list[str], int]],
    steps: int,
    *,
    lr: float = 2e-3,
    r: int = 8,
    seq: int = 128,
    seed: int = 0,
) -> dict:
    """Train a LoRA adapter (rank `r`, every projection) on `base` for `steps` steps and save
    it, unmerged, at `out`. Each step's batch takes `rows` random rows of `seq` tokens from
    each (texts, rows) source, so a mix such as [(prose, 4), (code, 4)] teaches the new domain
    while holding the old one. Returns the first and the last losses."""
    tokenizer = hub.load_tokenizer(base)
    data = [(token_blocks(tokenizer, texts, seq), rows) for texts, rows in sources]

    def batch(gen: torch.Generator) -> dict:
        picks = [(b, torch.randint(0, b.shape[0], (rows,), generator=gen)) for b, rows in data]
        ids = torch.cat([b[i] for b, i in picks])
        return {"input_ids": ids, "labels": ids}

    return train_lora(base, out, batch, steps, lr=lr, r=r, seed=seed)


def sft_adapter(
    base: str,
    out: Path,
    records: str | list[str],
    steps: int,
    *,
    batch_size: int = 8,
    max_length: int = 384,
    lr: float = 1e-3,
    r: int = 8,
    seed: int = 0,
) -> dict:
    """A supervised LoRA fine-tune of `base` on chat records (files in data/sources.py's
    forms, e.g. JSONL of {"messages": [...]}) rendered with the base's chat template: the loss
    on the assistant's tokens only (data/tokenize.py's mask), `batch_size` random records per
    step. The adapter is saved unmerged at `out`; returns the first and the last losses."""
    tokenizer = hub.load_tokenizer(base)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    data, _ = build_datasets(
        tokenizer, records, records, max_length=max_length, pack=False, seed=seed
    )
    if len(data) == 0:
        raise UserError(f"sft: no trainable records in {records}")

    def batch(gen: torch.Generator) -> dict:
        picks = torch.randint(0, len(data), (batch_size,), generator=gen).tolist()
        items = collate([data[i] for i in picks], pad)
        labels = items["input_ids"].masked_fill(~items["loss_mask"], IGNORE)
        return {"input_ids": items["input_ids"], "attention_mask": items["attention_mask"],
                "labels": labels}  # fmt: skip

    return train_lora(base, out, batch, steps, lr=lr, r=r, seed=seed)


def train_lora(
    base: str,
    out: Path,
    batch: Callable[[torch.Generator], dict],
    steps: int,
    *,
    lr: float,
    r: int,
    seed: int,
) -> dict:
    """`steps` AdamW steps of a rank-`r` LoRA on every projection of `base`, each on
    `batch(generator)` (the model's keyword arguments, labels included); the adapter saved
    unmerged at `out`. Returns {steps, loss_first, loss_last (mean of the last five)}."""
    # lazy: peft is slow to import; the online demo fine-tunes only with --shift target
    from peft import LoraConfig, get_peft_model

    if steps < 1:
        raise UserError(f"a fine-tune needs at least one step; got {steps}")
    model = hub.load_model(base)
    model.name_or_path = base  # recorded as the adapter's base_model_name_or_path
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=LORA_MODULES, task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for _ in tqdm(range(steps), desc="fine-tune", disable=None, mininterval=5):
        loss = model(**batch(gen)).loss
        if not torch.isfinite(loss):
            raise UserError(f"fine-tune: the loss is {loss.item()} at step {len(losses) + 1}")
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.save_pretrained(out)
    tail = losses[-5:]
    return {"steps": steps, "loss_first": losses[0], "loss_last": sum(tail) / len(tail)}


def merge_adapter(base: str, adapter: Path, out: Path) -> Path:
    """The merged target (base weights + the LoRA's s·B·A) saved at `out` with the base's
    tokenizer: a plain model directory any engine or `--target` loads."""
    model = hub.load_target(base, str(adapter)).merge_and_unload()
    model.save_pretrained(out)
    hub.load_tokenizer(base).save_pretrained(out)
    return Path(out)
