"""How fast `specdistill prepare` answers: tokens/s by batch size and verification kernel.

    python -m benchmarks.prepare_rate --recipe recipes/smollm2-standalone.yaml --prompts 64

Answers the first `--prompts` training prompts of the recipe's `prepare` section at its
settings (temperature, max_new_tokens, seed) into fresh directories, once per configuration:
the lean forward without oneDNN's prepacked weights (`models.lean.PACKED_FROM = 0`), batches
of 16 handed to the engine one at a time (`regenerate.CHUNK_BATCHES = 1`: a batch waits for
its longest answer); then with prepacked weights; then as shipped, at each of
`--batch-sizes`, CHUNK_BATCHES batches at a time (rows refilled as answers end); then at the
largest batch size keeping the top N of every answer token too (`prepare.top_n`, train/
captured.py; the recipe's N, else 64), which counts only the tokens written. These prefill
the rows admitted together in one forward, padded to the longest prompt
(`kv_cache.PREFILL_SLACK` infinite), and attend with SDPA (`attention.ATTENTION_ROWS` 0). The
last two prefill in groups of similar length (models/kv_cache.py `length_groups`); the last,
as shipped, also attends with a few query rows as two matrix products (models/attention.py).
Two prompts are answered first, untimed: the first forwards' one-time work (weight copies,
kernel probes) counts against no configuration.
Prints each configuration's answer tokens, seconds and tokens/s, and its ratio to the first,
measured in the same process. Run it alone on the machine: any other process moves the
numbers.
"""

import argparse
import math
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

from specdistill.models import attention, hub, kv_cache, lean
from specdistill.train import regenerate as regen
from specdistill.train.config import load_recipe
from specdistill.train.prepare import answer_tokens
from specdistill.train.regenerate import Sampling, regenerate


class Config(NamedTuple):
    name: str
    packed_from: int  # lean.PACKED_FROM (0: no prepacked weights)
    batch: int
    chunk_batches: int  # regenerate.CHUNK_BATCHES (1: a batch waits for its longest answer)
    top_n: int | None = None  # the top N kept while answering
    slack: float = math.inf  # kv_cache.PREFILL_SLACK (infinite: one padded prefill)
    rows: int = 0  # attention.ATTENTION_ROWS (0: SDPA everywhere)


def plan(shipped: int, chunks: int, sizes: list[int], top_n: int, grouped: float, rows: int):
    """The configurations, in the order they run: the old settings first, as shipped last."""
    old = dict(slack=math.inf, rows=0)  # one padded prefill per admission; SDPA everywhere
    configs = [
        Config("no prepacked weights, no refill", 0, 16, 1, **old),
        Config("prepacked, no refill", shipped, 16, 1, **old),
    ]
    configs += [Config("prepacked, refilled", shipped, b, chunks, **old) for b in sizes]
    kept = Config(
        f"prepacked, refilled, top {top_n} kept", shipped, max(sizes), chunks, top_n, **old
    )
    configs += [
        kept,
        kept._replace(name=f"{kept.name}, prefills grouped by length", slack=grouped),
        kept._replace(
            name=f"{kept.name}, prefills grouped, attention of few rows as matrix products",
            slack=grouped,
            rows=rows,
        ),
    ]
    return configs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/smollm2-standalone.yaml")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-sizes", default="16,32", help="batches tried as shipped")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    recipe = load_recipe(args.recipe, [])
    p, t = recipe.prepare, recipe.target
    tokenizer = hub.load_tokenizer(t.model, t.revision)
    target = hub.load_target(t.model, t.adapter, dtype=t.dtype, revision=t.revision)
    sampling = Sampling(p.temperature, None, None, p.max_new_tokens, p.seed)
    data = recipe.data.model_copy(update={"train": list(p.train.prompts)})
    recipe = recipe.model_copy(update={"data": data})
    shipped, chunks = lean.PACKED_FROM, regen.CHUNK_BATCHES
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    top_n = p.top_n or 64
    grouped, rows_shipped = kv_cache.PREFILL_SLACK, attention.ATTENTION_ROWS
    configs = plan(shipped, chunks, sizes, top_n, grouped, rows_shipped)
    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        # every first forward's one-time work (copies of the weights, the kernel probe) first
        regenerate(
            recipe,
            Path(tmp) / "warm",
            sampling=sampling,
            batch_size=2,
            limit=2,
            target=target,
            tokenizer=tokenizer,
            print=lambda *a, **k: None,
        )
        for i, (name, packed_from, batch, chunk_batches, top, slack, attn) in enumerate(configs):
            lean.PACKED_FROM, regen.CHUNK_BATCHES = packed_from, chunk_batches
            kv_cache.PREFILL_SLACK, attention.ATTENTION_ROWS = slack, attn
            out = Path(tmp) / f"run{i}"
            start = time.perf_counter()
            regenerate(
                recipe,
                out,
                sampling=sampling,
                batch_size=batch,
                limit=args.prompts,
                target=target,
                tokenizer=tokenizer,
                capture_top_n=top,
                print=lambda *a, **k: None,
            )
            seconds = time.perf_counter() - start
            tokens = answer_tokens(out)
            rate = tokens / seconds
            base = base or rate
            rows.append(
                f"| {name} | {batch} | {tokens} | {seconds:.0f} | {rate:.1f} | {rate / base:.2f}× |"
            )
    lean.PACKED_FROM, regen.CHUNK_BATCHES = shipped, chunks
    kv_cache.PREFILL_SLACK, attention.ATTENTION_ROWS = grouped, rows_shipped
    print(
        f"{t.model}, {args.prompts} prompts, T = {p.temperature}, max_new_tokens "
        f"{p.max_new_tokens}, {args.threads} thread(s)"
    )
    print("| kernel, batching | batch | answer tokens | s | tokens/s | ratio |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
