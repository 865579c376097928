"""Pretraining an embedded model from scratch: the corpus (`corpus_texts`), the family's
tokenizer (`new_tokenizer`) and the model (`train_model`: packed blocks, AdamW with warmup
and cosine decay, optional progressive stacking, held-out loss). Deterministic for a spec.
models/embedded.py calls these under its build lock and publishes the results.
"""

import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from specdistill.data.stdlib import stdlib_files, stdlib_prose
from specdistill.models.embedded_specs import (
    BUILD_RECORD,
    CHAT_TEMPLATE,
    EOS,
    SPECIAL_TOKENS,
    CorpusSpec,
    EmbeddedSpec,
)
from specdistill.models.model_lock import model_lock
from specdistill.progress import WorkProgress
from specdistill.threads import ThreadPolicy

PREFIX = "[specdistill embedded] "


def log(message: str) -> None:
    print(PREFIX + message, file=sys.stderr, flush=True)


def _spread(files: list[Path], n: int | None) -> list[Path]:
    """`n` files evenly spread over the sorted list (all of them when `n` is None)."""
    if n is None or n >= len(files):
        return files
    return [files[i * len(files) // n] for i in range(n)]


def corpus_texts(corpus: CorpusSpec, split: str) -> list[str]:
    n = corpus.train_files if split == "train" else corpus.heldout_files
    if corpus.text == "prose":
        return list(_spread(list(stdlib_prose(split)), n))
    files = _spread(stdlib_files(split), n)
    return [path.read_text(encoding="utf-8", errors="replace") for path in files]


def new_tokenizer(corpus: CorpusSpec) -> PreTrainedTokenizerFast:
    """The family's byte-level BPE tokenizer, trained on its corpus's train split."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=corpus.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_texts(corpus, "train"), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


# --- model -------------------------------------------------------------------------------


def _token_stream(tokenizer: tokenizers.Tokenizer, texts: list[str], eos_id: int) -> torch.Tensor:
    """All documents as one id stream, each followed by EOS: [n_tokens] int64."""
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    return torch.cat([torch.tensor([*e.ids, eos_id]) for e in encodings])


def _blocks(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut the stream into non-overlapping blocks: [n_blocks, seq_len]."""
    n_blocks = len(stream) // seq_len
    return stream[: n_blocks * seq_len].view(n_blocks, seq_len)


# --- model -------------------------------------------------------------------------------


def train_step(model, optimizer, scheduler, input_ids: torch.Tensor) -> float:
    """One next-token-loss step on `input_ids: [batch, seq]`; returns the loss."""
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


@torch.no_grad()
def _eval_loss(model, blocks: torch.Tensor, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats) over `blocks: [n, seq]`."""
    model.eval()
    total, count = 0.0, 0
    for batch in blocks.split(batch_size):
        logits = model(input_ids=batch).logits[:, :-1].float()
        total += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        count += batch[:, 1:].numel()
    model.train()
    return float(total) / count


def _unigram_loss(train: torch.Tensor, blocks: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy of the add-one unigram distribution of `train` on the targets of `blocks`."""
    counts = torch.bincount(train, minlength=vocab_size).double() + 1
    log_probs = (counts / counts.sum()).log()
    return float(-log_probs[blocks[:, 1:]].mean())


def _lr_lambda(spec: EmbeddedSpec):
    """Linear warmup, then cosine decay to 10% of the peak."""

    def factor(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _optimizer(model, spec: EmbeddedSpec, first_step: int):
    """AdamW (weight decay on matrices only) and the spec's schedule from `first_step` on."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.95),
    )
    factor = _lr_lambda(spec)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: factor(first_step + s))


def grown(model, config: LlamaConfig):
    """A `config.num_hidden_layers`-layer copy of `model` with each layer repeated k times.

    Every copy's residual outputs (o_proj, down_proj) are divided by k: k copies of a layer
    that each add f(x) / k add about f(x), so the deep model starts near the shallow one.
    """
    shallow = model.state_dict()
    k = config.num_hidden_layers // model.config.num_hidden_layers
    with torch.random.fork_rng(devices=[]), model_lock():
        deep = LlamaForCausalLM(config)  # every weight is overwritten below
    state = {}  # load_state_dict copies every tensor into the deep model's own parameters
    for key in deep.state_dict():
        if ".layers." not in key:
            state[key] = shallow[key]
            continue
        head, rest = key.split(".layers.")
        index, tail = rest.split(".", 1)
        weight = shallow[f"{head}.layers.{int(index) // k}.{tail}"]
        if tail in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            weight = weight / k
        state[key] = weight
    deep.load_state_dict(state)
    deep.tie_weights()
    return deep


def _threads() -> str:
    n = torch.get_num_threads()
    return f"{n} thread" + ("s" if n > 1 else "")


def step_cost(spec: EmbeddedSpec, num_layers: int) -> int:
    """The work of one training step at `num_layers` layers, for the build's ETA: layers x
    tokens, the output head (with the embedding and the loss) counted as one more layer. A
    step at 20 layers then counts 21/5 of one at 4, not 20/4: the head costs the same at
    both depths (a layer count alone would overstate the deep phase)."""
    return (num_layers + 1) * spec.batch_size * spec.seq_len


def train_model(
    name: str,
    spec: EmbeddedSpec,
    tokenizer_dir: Path,
    out: Path,
    threads: ThreadPolicy | None = None,
) -> dict:
    """Pretrain `spec` from scratch and save model and tokenizer into `out`; the build
    record's fields about the run (models/embedded.py writes the record). `threads`, when
    given, is re-checked between steps (specdistill/threads.py)."""
    start = time.perf_counter()
    corpus = _TokenCorpus.load(spec, tokenizer_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        with model_lock():
            model = LlamaForCausalLM(
                _llama_config(spec, corpus, spec.grow_from_layers or spec.num_layers)
            )
    stages = ""
    if spec.grow_from_layers:
        stages = f" (the first {spec.grow_at_step} at {spec.grow_from_layers} layers)"
    log(
        f"building '{name}' (once, then cached): {spec.num_layers}-layer Llama, "
        f"{spec.steps} steps x {spec.batch_size}x{spec.seq_len} tokens{stages} "
        f"from {len(corpus.train):,} training tokens, on {_threads()}"
    )
    model = _pretrain(name, spec, corpus, model, threads)
    return _save_and_describe(name, spec, corpus, model, tokenizer_dir, out, start)


@dataclass
class _TokenCorpus:
    """The spec's corpus as token ids: the training stream and its blocks, the held-out
    blocks evaluated at the end, and the tokenizer's EOS id and vocabulary size."""

    eos_id: int
    vocab_size: int
    train: torch.Tensor  # [n_tokens]
    train_blocks: torch.Tensor  # [n_blocks, seq_len]
    eval_blocks: torch.Tensor  # [eval_blocks, seq_len], evenly spread over the held-out ones

    @classmethod
    def load(cls, spec: EmbeddedSpec, tokenizer_dir: Path) -> "_TokenCorpus":
        tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        eos_id = tokenizer.token_to_id(EOS)
        vocab_size = tokenizer.get_vocab_size()
        train = _token_stream(tokenizer, corpus_texts(spec.corpus, "train"), eos_id)
        heldout = _token_stream(tokenizer, corpus_texts(spec.corpus, "heldout"), eos_id)
        train_blocks = _blocks(train, spec.seq_len)
        heldout_blocks = _blocks(heldout, spec.seq_len)
        pick = torch.linspace(
            0, len(heldout_blocks) - 1, min(spec.eval_blocks, len(heldout_blocks))
        )
        eval_blocks = heldout_blocks[pick.long()]
        return cls(eos_id, vocab_size, train, train_blocks, eval_blocks)


def _llama_config(spec: EmbeddedSpec, corpus: _TokenCorpus, num_layers: int) -> LlamaConfig:
    eos_id = corpus.eos_id
    return LlamaConfig(
        vocab_size=corpus.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def _pretrain(
    name: str,
    spec: EmbeddedSpec,
    corpus: _TokenCorpus,
    model,
    threads: ThreadPolicy | None,
):
    """`spec.steps` steps over shuffled training blocks, growing the model at
    `spec.grow_at_step` when the spec grows it, with a progress line; the trained model."""

    def layers_at(step: int) -> int:
        if spec.grow_from_layers and step < spec.grow_at_step:
            return spec.grow_from_layers
        return spec.num_layers

    train_blocks = corpus.train_blocks
    costs = [step_cost(spec, layers_at(step)) for step in range(spec.steps)]
    progress = WorkProgress(f"building '{name}'", sum(costs), prefix=PREFIX)
    optimizer, scheduler = _optimizer(model, spec, 0)
    generator = torch.Generator().manual_seed(spec.seed)
    order = torch.randperm(len(train_blocks), generator=generator)
    cursor = 0
    model.train()
    with progress:
        for step in range(spec.steps):
            if spec.grow_from_layers and step == spec.grow_at_step:
                model = grown(model, _llama_config(spec, corpus, spec.num_layers))
                model.train()
                optimizer, scheduler = _optimizer(model, spec, step)
                progress.note(f"'{name}' step {step}: grown to {spec.num_layers} layers")
            if cursor + spec.batch_size > len(order):
                order, cursor = torch.randperm(len(train_blocks), generator=generator), 0
            batch = train_blocks[order[cursor : cursor + spec.batch_size]]
            cursor += spec.batch_size
            loss = train_step(model, optimizer, scheduler, batch)
            progress.advance(costs[step], f"step {step + 1}/{spec.steps}, loss {loss:.3f}")
            if threads is not None:
                threads.recheck(say=progress.note)
    return model


def _save_and_describe(
    name: str,
    spec: EmbeddedSpec,
    corpus: _TokenCorpus,
    model,
    tokenizer_dir: Path,
    out: Path,
    start: float,
) -> dict:
    """Evaluate the held-out loss, save model and tokenizer into `out`; the build record's
    fields about the run (`start`: the build's `time.perf_counter()`)."""
    eos_id, eval_blocks = corpus.eos_id, corpus.eval_blocks
    n_params = sum(p.numel() for p in model.parameters())
    heldout_loss = _eval_loss(model, eval_blocks, spec.batch_size)
    unigram_loss = _unigram_loss(corpus.train, eval_blocks, corpus.vocab_size)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False
    )
    model.save_pretrained(out)
    for file in tokenizer_dir.iterdir():
        if file.name != BUILD_RECORD:
            shutil.copy2(file, out / file.name)
    wall = time.perf_counter() - start
    fields = dict(
        name=name,
        seed=spec.seed,
        python=sys.version.split()[0],
        torch=torch.__version__,
        transformers=transformers.__version__,
        n_params=n_params,
        train_steps=spec.steps,
        train_tokens=spec.steps * spec.batch_size * spec.seq_len,
        heldout_loss=round(heldout_loss, 4),
        heldout_unigram_loss=round(unigram_loss, 4),
        heldout_eval_tokens=eval_blocks[:, 1:].numel(),
        wall_time_s=round(wall, 1),
    )
    log(
        f"built '{name}' in {wall:.0f}s: held-out loss {heldout_loss:.3f} "
        f"(perplexity {math.exp(heldout_loss):.1f}; unigram {unigram_loss:.3f})"
    )
    return fields
