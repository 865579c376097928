"""An EAGLE-3 head's stored outputs made by the project's target forward or by vLLM, side by
side, in one run: the hidden states entering the head's layers and the target's
log-probabilities at every position of the recipe's answered training sequences.

    python -m benchmarks.feature_engines --recipe recipes/smollm2-standalone.yaml --sequences 64

The first `--sequences` training sequences of the recipe's data (its answers, through the chat
template, as distill sees them). The project's way (train/target_cache_build.py): a
transformers forward of the float32 target, `--batch-size` sequences at a time, capturing the
hidden states entering the layers (`drafts.eagle3.features.FeatureCapture`) and the
log-softmax at every position. vLLM's (eval/vllm_features.py): one prefill of every sequence
returning the hidden states entering the layers and the last layer's output before the final
norm, from which the project's target computes the log-softmax (its final norm and output
head, in float32). vLLM runs eagerly in each dtype of `--dtypes`, then compiled in the last.
Each vLLM start is a column of its own and is not in the rate; one sequence goes through each
way first, untimed. Printed per way: positions per second, the ratio to the project's forward
measured in the same run, and how far its outputs are from the project's float32 forward:
the largest difference of the hidden states relative to their largest magnitude, and the mean
total variation between the two log-softmaxes over the whole vocabulary. Run it alone.
"""

import argparse
import time

import torch

from benchmarks.answer_engines import cpu_name
from benchmarks.results import markdown_table
from specdistill.data import collate
from specdistill.drafts.eagle3.features import FeatureCapture, decoder_layers, default_aux_layers
from specdistill.eval.vllm_engine import VllmSettings
from specdistill.eval.vllm_features import VllmFeatures
from specdistill.models import hub
from specdistill.models.target_spec import TargetSpec, load_target_and_tokenizer
from specdistill.train.config import load_recipe, recipe_datasets
from specdistill.train.target_cache_vocab import head_logits

HEADER = ["way", "dtype", "start s", "positions", "s", "positions/s", "ratio", "features Δ", "TV"]


def torch_way(target, items, layers, batch_size: int, pad: int):
    """(seconds, [(features [T, k·H], logprobs [T, V])] per sequence) by a float32 forward of
    `batch_size` right-padded sequences at a time, as the cache build runs it."""
    out, seconds = [], 0.0
    for first in range(0, len(items), batch_size):
        group = items[first : first + batch_size]
        batch = collate(
            [
                {"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(ids) >= 0}
                for ids in group
            ],
            pad,
        )
        t0 = time.perf_counter()
        with torch.no_grad(), FeatureCapture(target, layers) as capture:
            logits = target(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
        logp = logits.float().log_softmax(-1)
        seconds += time.perf_counter() - t0
        features = capture.features().float()
        out += [(features[b, : len(ids)], logp[b, : len(ids)]) for b, ids in enumerate(group)]
    return seconds, out


def vllm_way(path, target, items, layers, settings):
    """(start seconds, seconds, [(features, logprobs)] per sequence) by vLLM's prefill."""
    t0 = time.perf_counter()
    engine = VllmFeatures(path, [*layers, len(decoder_layers(target))], settings)
    started = time.perf_counter() - t0
    try:
        engine.hidden_states(items[:1])  # untimed: a first call's one-time work
        t0 = time.perf_counter()
        states = engine.hidden_states(items)
        width = len(layers) * target.config.hidden_size
        out = [(s[:, :width], head_logits(target, s[:, width:]).log_softmax(-1)) for s in states]
        seconds = time.perf_counter() - t0
    finally:
        engine.close()
    return started, seconds, out


def distance(reference, got) -> tuple[float, float]:
    """(largest feature difference over the largest feature magnitude, mean TV)."""
    diff = scale = tv = 0.0
    n = 0
    for (f_ref, lp_ref), (f, lp) in zip(reference, got, strict=True):
        diff = max(diff, (f - f_ref).abs().max().item())
        scale = max(scale, f_ref.abs().max().item())
        tv += 0.5 * (lp.exp() - lp_ref.exp()).abs().sum(-1).sum().item()
        n += len(lp)
    return diff / scale, tv / n


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/smollm2-standalone.yaml")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    r = load_recipe(args.recipe, [f"train.threads={args.threads}"])
    target, tokenizer = load_target_and_tokenizer(TargetSpec.from_recipe(r.target))
    target = target.float().eval()
    train, _ = recipe_datasets(r, tokenizer)
    items = [train[i]["input_ids"].tolist() for i in range(min(args.sequences, len(train)))]
    layers = default_aux_layers(len(decoder_layers(target)))
    positions = sum(len(ids) for ids in items)
    pad = tokenizer.pad_token_id
    torch_way(target, items[:1], layers, 1, pad)  # untimed warm-up
    seconds, reference = torch_way(target, items, layers, args.batch_size, pad)
    base = positions / seconds
    rows = [["specdistill forward", "float32", "0", f"{positions:,}", f"{seconds:.1f}"]]
    rows[0] += [f"{base:.0f}", "1.00×", "0", "0"]
    path = hub.local_model_dir(r.target.model) or r.target.model
    dtypes = args.dtypes.split(",")
    plan = [(d, False) for d in dtypes] + [(dtypes[-1], True)]
    for dtype, compiled in plan:
        settings = VllmSettings(dtype, compiled, max_num_seqs=64, threads=args.threads)
        started, seconds, got = vllm_way(path, target, items, layers, settings)
        diff, tv = distance(reference, got)
        mode = "compiled" if compiled else "eager"
        rate = positions / seconds
        rows.append([f"vllm prefill, {mode}", dtype, f"{started:.0f}", f"{positions:,}"])
        rows[-1] += [f"{seconds:.1f}", f"{rate:.0f}", f"{rate / base:.2f}×"]
        rows[-1] += [f"{diff:.1e}", f"{tv:.4f}"]
    print(f"{len(items)} sequences, layers {layers} and the last layer's output; {cpu_name()}")
    print(markdown_table(HEADER, rows))


if __name__ == "__main__":
    main()
