"""How far the top N kept while answering are from the float32 target that training is measured
against: the kept distributions (`OUT/captured/`, written by `specdistill prepare` in the dtype
and engine its manifest names) against a float32 transformers forward over the same tokens.

    python -m benchmarks.kept_precision --recipe recipes/smollm2-standalone.yaml --answers 200

For the first `--answers` kept answers, at every answer position: the total variation between
the kept distribution and the float32 target's over N + 1 bins (the kept N tokens and the rest,
as the loss reads them: losses.SparseTarget's rest bin), the float32 target's mass on the kept
N, and whether the most probable token is the same. An acceptance rate a draft could reach
against the kept targets is at most 1 − TV away from the float32 target's, position by
position: the mean TV bounds what answering in another dtype costs a perfect draft.
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors import safe_open

from specdistill.models.target_spec import TargetSpec, load_target_and_tokenizer
from specdistill.train.config import load_recipe


def parts(out: Path):
    """(prompt ids, completion ids, indices, logprobs) per kept answer, in order."""
    for path in sorted((out / "captured").glob("part-*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        p_off, c_off = t["prompt_offsets"].tolist(), t["completion_offsets"].tolist()
        for r in range(len(p_off) - 1):
            a, b = c_off[r], c_off[r + 1]
            yield (
                t["prompt_ids"][p_off[r] : p_off[r + 1]].long(),
                t["completion_ids"][a:b].long(),
                t["indices"][a:b].long(),
                t["logprobs"][a:b].float(),
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/smollm2-standalone.yaml")
    parser.add_argument("--answers", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    recipe = load_recipe(args.recipe, [])
    out = Path(recipe.prepare.train.out)
    manifest = json.loads((out / "manifest.json").read_text())
    spec = TargetSpec.from_recipe(recipe.target.model_copy(update={"dtype": "float32"}))
    target, _ = load_target_and_tokenizer(spec)
    target.eval()
    tv, covered, same_top, positions, answers = 0.0, 0.0, 0, 0, 0
    for prompt, completion, indices, logprobs in parts(out):
        if answers == args.answers:
            break
        answers += 1
        ids = torch.cat([prompt, completion])[None]
        with torch.no_grad():
            logits = target(ids).logits[0, len(prompt) - 1 : -1].float()
        p = torch.softmax(logits, dim=-1)  # [T, V] float32 target
        p_kept = p.gather(1, indices)  # its mass on the kept tokens
        q_kept = logprobs.exp()
        rest_p, rest_q = (1 - p_kept.sum(1)).clamp_min(0), (1 - q_kept.sum(1)).clamp_min(0)
        tv += (0.5 * ((p_kept - q_kept).abs().sum(1) + (rest_p - rest_q).abs())).sum().item()
        covered += p_kept.sum().item()
        same_top += (p.argmax(1) == indices[:, 0]).sum().item()
        positions += len(completion)
    print(
        f"{manifest['engine']} against the float32 target, {answers} answers, "
        f"{positions:,} positions (top {indices.shape[1]} kept):"
    )
    print("| mean TV (N + 1 bins) | float32 mass on the kept N | same most probable token |")
    print("|---|---|---|")
    print(f"| {tv / positions:.4f} | {covered / positions:.4f} | {same_top / positions:.4f} |")


if __name__ == "__main__":
    main()
