"""The project's engine against vLLM answering a recipe's prompts, side by side, in one run.

    python -m benchmarks.answer_engines --recipe recipes/smollm2-standalone.yaml --prompts 64

Answers the first `--prompts` training prompts of the recipe's `prepare` section at its
settings (temperature, max_new_tokens, seed) into a fresh directory per configuration,
through `regenerate` (train/regenerate.py) as `specdistill prepare` does: each engine
(`--engines`), in each dtype (`--dtypes`), keeping the top N of every answer token for each N
of `--top-n` (0: none kept). vLLM runs eagerly, and once more compiled (`--compiled`: the
dtype and N of that row). Each engine is started once per dtype, untimed for the answering
rate (its start is a column of its own); two prompts are answered first, untimed, so that no
configuration pays a first forward's one-time work. Prints per configuration the answer
tokens, seconds, tokens/s, answers per hour (at this run's mean answer length) and the ratio
to the first row, the project's engine in float32 without the top N, measured in the same
run. Run it alone on the machine: any other process moves the numbers.
"""

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.results import markdown_table
from specdistill.models.target_spec import TargetSpec, load_target_and_tokenizer, load_tokenizer
from specdistill.train.answer_engine import VLLM, project_engine, vllm_engine
from specdistill.train.config import load_recipe
from specdistill.train.prepare import answer_tokens
from specdistill.train.regenerate import Sampling, regenerate

HEADER = [
    "engine",
    "dtype",
    "top N",
    "start s",
    "answer tokens",
    "s",
    "tokens/s",
    "answers/h",
    "ratio",
]


def cpu_name() -> str:
    """The processor's model name and whether it has AVX-512 with bfloat16."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    name = next(
        (line.split(":", 1)[1].strip() for line in text.splitlines() if "model name" in line), "?"
    )
    return f"{name}, {'avx512_bf16' if 'avx512_bf16' in text else 'no avx512_bf16'}"


def start(engine: str, recipe, dtype: str, tokenizer, batch: int, top_n: int, compiled: bool):
    """The engine ready to answer (an `AnswerEngine`), built for `dtype`."""
    target_cfg = recipe.target.model_copy(update={"dtype": dtype})
    r = recipe.model_copy(update={"target": target_cfg})
    if engine == VLLM:
        vllm = r.prepare.vllm.model_copy(update={"dtype": dtype, "compile": compiled})
        prepare = r.prepare.model_copy(update={"vllm": vllm})
        r = r.model_copy(update={"prepare": prepare})
        answerer = vllm_engine(r, tokenizer, batch_size=batch, top_n=top_n or None)
        answerer.model.start()  # vLLM starts at its first answer unless started
        return r, answerer
    target, _ = load_target_and_tokenizer(TargetSpec.from_recipe(target_cfg), tokenizer=tokenizer)
    return r, project_engine(r, target, tokenizer, None, lambda: None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/smollm2-standalone.yaml")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--engines", default="specdistill,vllm")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--top-n", default="0,20,64")
    parser.add_argument("--compiled", default="bfloat16:64", help="DTYPE:N, or none")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    recipe = load_recipe(args.recipe, [f"train.threads={args.threads}"])
    p = recipe.prepare
    tokenizer = load_tokenizer(TargetSpec.from_recipe(recipe.target))
    sampling = Sampling(p.temperature, None, None, p.max_new_tokens, p.seed)
    data = recipe.data.model_copy(update={"train": list(p.train.prompts)})
    recipe = recipe.model_copy(update={"data": data})
    tops = [int(n) for n in args.top_n.split(",")]
    plan = [(e, d, tops, False) for e in args.engines.split(",") for d in args.dtypes.split(",")]
    if args.compiled != "none" and VLLM in args.engines:
        dtype, n = args.compiled.split(":")
        plan.append((VLLM, dtype, [int(n)], True))
    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for engine, dtype, ns, compiled in plan:
            began = time.perf_counter()
            r, answerer = start(
                engine, recipe, dtype, tokenizer, args.batch_size, max(ns), compiled
            )
            started = time.perf_counter() - began
            try:
                warm = Path(tmp) / f"warm-{engine}-{dtype}-{compiled}"
                regenerate(
                    r,
                    warm,
                    sampling=sampling,
                    batch_size=2,
                    limit=2,
                    answerer=answerer,
                    print=lambda *a: None,
                )
                for n in ns:
                    out = Path(tmp) / f"{engine}-{dtype}-{n}-{compiled}"
                    t0 = time.perf_counter()
                    manifest = regenerate(
                        r,
                        out,
                        sampling=sampling,
                        batch_size=args.batch_size,
                        limit=args.prompts,
                        answerer=answerer,
                        capture_top_n=n or None,
                        print=lambda *a: None,
                    )
                    seconds = time.perf_counter() - t0
                    tokens = answer_tokens(out)
                    rate = tokens / seconds
                    base = base or rate
                    per_hour = 3600 * manifest["answered"] / seconds
                    mode = ", compiled" if compiled else (", eager" if engine == VLLM else "")
                    rows.append(
                        [f"{engine}{mode}", dtype, n, f"{started:.0f}", f"{tokens:,}"]
                        + [
                            f"{seconds:.0f}",
                            f"{rate:.0f}",
                            f"{per_hour:,.0f}",
                            f"{rate / base:.2f}×",
                        ]
                    )
                    print(*rows[-1], sep=" | ", flush=True)
            finally:
                answerer.close()
    print(
        f"\n{recipe.target.model}, {args.prompts} prompts, T = {p.temperature}, max_new_tokens "
        f"{p.max_new_tokens}, batch {args.batch_size}, {args.threads} threads; {cpu_name()}; "
        f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND', '-')}"
    )
    print(markdown_table(HEADER, rows))


if __name__ == "__main__":
    main()
