"""On-policy data (`data.on_policy`): part of each batch generated on the fly.

`data.on_policy.fraction` of the sequences of every optimiser step are not the dataset's:
the first `prompt_tokens` tokens of the sequence in that slot (null: its tokens before the
first trained one, a chat record's prompt) are kept as a prompt and the rest is generated
now, by the draft itself (`source: draft`, the student's own samples as in DistillSpec,
arXiv:2310.08461, and GKD, arXiv:2306.13649) or by the target through the speculative
decoding engine with the current draft (`source: target`: the target's distribution,
lossless, at a fraction of its cost; eval/engine.py). The loss then scores the
generated tokens only (loss_mask), with the target at every position as usual.

Determinism. Which slots of the global batch are on-policy is a function of the step alone
(evenly spread, `on_policy_slots`); a draft-sampled row draws its uniforms from its own
generator, seeded from (seed, step, slot), so its tokens do not depend on which rows it is
batched with; the engine (one generator per call) is called once per micro-batch, seeded
from (seed, step, the micro-batch's first slot). Micro-batches hold the same slots whatever
the number of processes, and the draft's weights at a step are the same in a resumed run,
so a resumed run and a run on 2 processes generate what one uninterrupted process does.
"""

import hashlib
import time

import torch

from specdistill.data import collate
from specdistill.eval.engine import generate
from specdistill.losses.sampling import probabilities
from specdistill.models.kv_cache import KVStream, eval_mode, sync
from specdistill.train.config import RecipeError
from specdistill.train.distributed import is_sharded, layout


def row_seed(*parts) -> int:
    """A 63-bit seed from (seed, step, slot, ...): independent streams for distinct tuples."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def on_policy_slots(global_batch: int, fraction: float) -> set[int]:
    """The global-batch slots (0-based) whose sequences are generated: fraction × global_batch
    of them (rounded half up), evenly spread (so every process and micro-batch gets its share)."""
    n = int(fraction * global_batch + 0.5)
    return {k * global_batch // n for k in range(n)} if n else set()


class OnPolicy:
    """Generates the on-policy rows of a trainer's micro-batches (`Trainer.micro_batches`).

    draft: the unwrapped draft module (None with a sharded draft: `source: target` then
    decodes with the target alone); kind: its draft type (drafts/).
    """

    def __init__(self, recipe, *, target, draft, tokenizer, vocab_size: int, device):
        self.cfg = recipe.data.on_policy
        self.seed = recipe.train.seed
        self.max_length = recipe.data.max_length
        self.slots = on_policy_slots(recipe.train.global_batch_size, self.cfg.fraction)
        # A peft LoRA draft: its base model holds the adapter layers and takes a KV cache
        # under the keyword transformers expects (PeftModel.forward hides it in **kwargs).
        if hasattr(draft, "get_base_model"):
            draft = draft.get_base_model()
        self.target, self.draft = target, draft
        self.pad_token_id = tokenizer.pad_token_id
        self.eos_token_id = tokenizer.eos_token_id
        self.vocab_size, self.device = vocab_size, device
        self.seconds, self.tokens = 0.0, 0

    # ------------------------------------------------------------------------- batches
    def batch(self, step: int, first_slot: int, batch: dict) -> dict:
        """`batch` (a collated micro-batch whose row i is global slot first_slot + i) with its
        on-policy rows replaced by prompt + generated tokens (loss_mask on the latter only)."""
        rows = [i for i in range(batch["input_ids"].shape[0]) if first_slot + i in self.slots]
        if not rows:
            return batch
        items = []
        for ids, mask, loss_mask in zip(
            batch["input_ids"].cpu(),
            batch["attention_mask"].cpu(),
            batch["loss_mask"].cpu(),
            strict=True,
        ):
            valid = mask.bool()
            items.append({"input_ids": ids[valid], "loss_mask": loss_mask[valid]})
        length = self.cfg.prompt_tokens
        prompts = [
            prompt_of(items[i]["input_ids"], items[i]["loss_mask"], length, self.max_length)
            for i in rows
        ]
        budgets = [self.budget(len(p)) for p in prompts]
        sync(self.device)
        start = time.perf_counter()
        if self.cfg.source == "draft":
            seeds = [row_seed(self.seed, step, first_slot + i) for i in rows]
            outputs = self.sample_draft(prompts, budgets, seeds)
        else:
            outputs = self.sample_target(prompts, budgets, row_seed(self.seed, step, first_slot))
        sync(self.device)
        self.seconds += time.perf_counter() - start
        for i, prompt, new in zip(rows, prompts, outputs, strict=True):
            self.tokens += len(new)
            items[i] = {
                "input_ids": torch.tensor(prompt + new, dtype=torch.long),
                "loss_mask": torch.tensor([False] * len(prompt) + [True] * len(new)),
            }
        out = collate(items, self.pad_token_id)
        return {k: v.to(batch["input_ids"].device) for k, v in out.items()}

    def budget(self, prompt_length: int) -> int:
        """New tokens for a prompt: up to data.max_length in all, at most max_new_tokens."""
        room = self.max_length - prompt_length
        cap = self.cfg.max_new_tokens
        return max(1, min(room, cap) if cap is not None else room)

    def take_metrics(self, accelerator) -> dict:
        """{onpolicy/gen_s: mean seconds per process this step, onpolicy/tokens: generated
        tokens over all processes}; resets the counters. Every process must call it."""
        local = torch.tensor([self.seconds, self.tokens], dtype=torch.float64)
        total = accelerator.reduce(local.to(accelerator.device), "sum").cpu()
        self.seconds, self.tokens = 0.0, 0
        return {
            "onpolicy/gen_s": float(total[0]) / accelerator.num_processes,
            "onpolicy/tokens": int(total[1]),
        }

    # ------------------------------------------------------------------------- sources
    @torch.no_grad()
    def sample_draft(self, prompts: list[list[int]], budgets: list[int], seeds: list[int]):
        """The draft's own samples at data.on_policy.temperature (0: greedy), batched on a KV
        cache. Row i's uniforms come from its own generator (`seeds[i]`, on the CPU), so its
        tokens do not depend on the other rows, nor on the device. A row stops after EOS."""
        temperature, n = self.cfg.temperature, max(budgets)
        uniforms = torch.stack(
            [
                torch.rand(n, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
                for s in seeds
            ]
        ).to(self.device)
        with eval_mode(self.draft):
            stream = KVStream(self.draft, self.vocab_size, self.device)
            logits = stream.admit(prompts)[0]
            out = torch.empty(len(prompts), n, dtype=torch.long, device=self.device)
            done = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
            one = torch.ones(len(prompts), 1, dtype=torch.bool, device=self.device)
            for t in range(n):
                if temperature == 0:
                    token = logits.argmax(-1)
                else:
                    token = inverse_cdf(probabilities(logits.float(), temperature), uniforms[:, t])
                out[:, t] = token
                if self.eos_token_id is not None:
                    done |= token == self.eos_token_id
                if t == n - 1 or bool(done.all()):
                    break
                logits = stream.forward(token[:, None], one, keep=1)[:, -1]
        rows = zip(out.tolist(), budgets, strict=True)
        return [cut(row[:b], self.eos_token_id) for row, b in rows]

    def sample_target(self, prompts: list[list[int]], budgets: list[int], seed: int):
        """The target's samples, by speculative decoding with the current draft (lossless:
        distributed as the target's own sampling, eval/engine.py)."""
        gen = generate(
            self.target,
            self.draft,
            prompts,
            gamma=self.cfg.gamma if self.draft is not None else 0,
            temperature=self.cfg.temperature,
            max_new_tokens=max(budgets),
            seed=seed,
            eos_token_id=self.eos_token_id,
            vocab_size=self.vocab_size,
        )
        rows = zip(gen.sequences, budgets, strict=True)
        return [cut(row[:b], self.eos_token_id) for row, b in rows]


def prompt_of(ids: torch.Tensor, loss_mask: torch.Tensor, prompt_tokens: int | None,
              max_length: int) -> list[int]:  # fmt: skip
    """A training sequence's prompt: its first `prompt_tokens` tokens, or (None) every token
    before its first trained one (a chat record's prompt, up to the assistant's reply), at
    most max_length − 1 of them so that at least one token is generated."""
    if prompt_tokens is not None:
        return ids[:prompt_tokens].tolist()
    trained = loss_mask.nonzero()
    first = int(trained[0]) if len(trained) else len(ids)
    if first <= 1:  # loss_mask[0] is never set: text trains from token 1 on
        raise RecipeError(
            "data.on_policy.prompt_tokens is null, which takes each sequence's untrained "
            "tokens as its prompt, but this sequence is trained from its start (plain text, "
            "not a chat record): set data.on_policy.prompt_tokens to a number of tokens"
        )
    return ids[: min(first, max_length - 1)].tolist()


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [B, V] for given uniforms u [B] (as eval/verify.py draw)."""
    cdf = probs.double().cumsum(-1)
    token = torch.searchsorted(cdf, (u[:, None] * cdf[:, -1:]), right=True)
    token = token.clamp_max(probs.shape[-1] - 1)
    empty = probs.gather(-1, token) == 0  # u · total rounded up to the total
    return torch.where(empty, probs.argmax(-1, keepdim=True), token).squeeze(-1)


def cut(tokens: list[int], eos_token_id: int | None) -> list[int]:
    """`tokens` up to and including the first EOS."""
    if eos_token_id is not None and eos_token_id in tokens:
        return tokens[: tokens.index(eos_token_id) + 1]
    return tokens


def for_core(recipe, core, tokenizer) -> OnPolicy:
    """The generator of data.on_policy rows for the step core `core` (train/step.py). A
    sharded draft cannot write alone: source=draft is refused there, source=target decodes
    with the target."""
    acc, source = core.accelerator, recipe.data.on_policy.source
    if is_sharded(acc) and source == "draft":
        raise RecipeError(
            f"data.on_policy.source=draft is not supported with a sharded draft "
            f"({layout(acc)}): use data.on_policy.source=target or a replicated layout"
        )
    return OnPolicy(
        recipe,
        target=core.target,
        draft=None if is_sharded(acc) else core.draft_module(),
        tokenizer=tokenizer,
        vocab_size=core.vocab_size,
        device=acc.device,
    )
