"""A peft LoRA fine-tune of a target on a mixture of texts.

The fine-tuned targets of the demos: `benchmarks/drift_demo.py` (a target fine-tuned on prose,
to measure α drift) and `specdistill online demo --shift target` (a served target that knows a
domain its draft was never fit on). The adapter is saved unmerged; `drafts.hub.load_target`
loads it on top of the base (docs/drift.md).
"""

from pathlib import Path

import torch

from specdistill.errors import UserError

LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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
    from peft import LoraConfig, get_peft_model

    from specdistill.drafts import hub

    tokenizer = hub.load_tokenizer(base)
    data = [(token_blocks(tokenizer, texts, seq), rows) for texts, rows in sources]
    model = hub.load_model(base)
    model.name_or_path = base  # recorded as the adapter's base_model_name_or_path
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=LORA_MODULES, task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for _ in range(steps):
        picks = [(b, torch.randint(0, b.shape[0], (rows,), generator=gen)) for b, rows in data]
        batch = torch.cat([b[i] for b, i in picks])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.save_pretrained(out)
    tail = losses[-5:]
    return {"steps": steps, "loss_first": losses[0], "loss_last": sum(tail) / len(tail)}
