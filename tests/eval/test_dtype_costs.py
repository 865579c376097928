"""What a decoded round costs beyond its arithmetic, per dtype: the engine converts no weight,
reads the device once a round, and converts logits to float32 only where it samples.

Models this small are launch-bound on a GPU, where a conversion of a weight-sized tensor or a
host synchronisation per token costs more than the matrix products. These counts are the same
on the CPU, so they are pinned here, for float32, bfloat16 and float16 alike, and a change that
adds one fails:
- no dtype conversion of a weight, anywhere (inside the models' forwards included);
- host reads: one `Tensor.tolist` per round (the round's accepted counts and tokens), and
  scalar reads (`item`, `int(t)`, `bool(t)`) only in the KV cache's bookkeeping
  (`KVStream.drop_last`, `select_rows`, `admit`: at most 4 per call, its shortest rollback,
  its leading padding, its longest row), none anywhere else;
- outside the models' forwards (`KVStream.forward`, lean or transformers'), no conversion of
  logits at T = 0; at T = 1 at most γ + 1 a round: each draft step's logits and the
  verification's, to float32 for sampling.
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from specdistill.eval.engine import generate
from specdistill.models import kv_cache

GAMMA = 3
PROMPTS = [[5, 17, 30, 44, 9], [7, 8, 9]]


class Conversions(TorchDispatchMode):
    """Counts dtype conversions (aten.to / _to_copy to another dtype) of `weights`' storages,
    and of logits ([..., vocab_size]) outside the models' forwards; and scalar reads of a
    tensor (aten.item / _local_scalar_dense) inside and outside the KV cache's bookkeeping.
    `inside` counts how deep each kind of call ("forward", "bookkeeping") is now."""

    def __init__(self, weights: set[int], vocab_size: int):
        super().__init__()
        self.weights, self.vocab_size = weights, vocab_size
        self.inside = collections.Counter()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        source = args[0] if args else None
        if name in ("aten.item", "aten._local_scalar_dense"):
            where = "bookkeeping" if self.inside["bookkeeping"] else "elsewhere"
            self.counts[f"scalar_reads_{where}"] += 1
        elif (
            name in ("aten.to", "aten._to_copy")
            and isinstance(out, torch.Tensor)
            and isinstance(source, torch.Tensor)
            and out.dtype != source.dtype
        ):
            if source.untyped_storage().data_ptr() in self.weights:
                self.counts["weight"] += 1
            if not self.inside["forward"] and source.shape[-1:] == (self.vocab_size,):
                self.counts["engine_logits"] += 1
        return out

    def counted(self, kind: str, method):
        """`method` wrapped so that the mode knows when it runs (and counts its calls)."""

        def wrapper(*args, **kwargs):
            self.inside[kind] += 1
            self.counts[f"{kind}_calls"] += 1
            try:
                return method(*args, **kwargs)
            finally:
                self.inside[kind] -= 1

        return wrapper


def measure(pair, dtype: torch.dtype, temperature: float, monkeypatch) -> tuple[dict, int]:
    """(counts, rounds) of one `generate` of the tiny pair in `dtype`."""
    target_dir, draft_dir, _ = pair
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).eval()
    weights = {p.untyped_storage().data_ptr() for m in (target, draft) for p in m.parameters()}
    mode = Conversions(weights, target.config.vocab_size)

    reads = collections.Counter()
    tolist = torch.Tensor.tolist

    def counted_tolist(t):  # no dispatch on the CPU: counted where Python calls it
        reads["tolist"] += 1
        return tolist(t)

    generate(target, draft, PROMPTS, gamma=GAMMA, max_new_tokens=4, temperature=temperature)
    stream = kv_cache.KVStream
    monkeypatch.setattr(stream, "forward", mode.counted("forward", stream.forward))
    for name in ("drop_last", "select_rows", "admit"):
        monkeypatch.setattr(stream, name, mode.counted("bookkeeping", getattr(stream, name)))
    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    with mode:
        g = generate(
            target, draft, PROMPTS, gamma=GAMMA, max_new_tokens=24, temperature=temperature
        )
    monkeypatch.undo()
    assert g.n_tokens == 48
    return {**mode.counts, **reads}, len(g.rounds)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_round_converts_no_weight_and_reads_the_device_once(
    tiny_pair, dtype, temperature, monkeypatch
):
    counts, rounds = measure(tiny_pair, dtype, temperature, monkeypatch)
    assert counts.get("weight", 0) == 0, counts
    assert counts.get("tolist", 0) == rounds, (counts, rounds)
    assert counts.get("scalar_reads_elsewhere", 0) == 0, counts
    assert counts.get("scalar_reads_bookkeeping", 0) <= 4 * counts["bookkeeping_calls"], counts
    logits = counts.get("engine_logits", 0)
    if temperature == 0 or dtype == torch.float32:
        assert logits == 0, counts  # greedy takes the argmax in the model's dtype
    else:
        assert 0 < logits <= (GAMMA + 1) * rounds, (counts, rounds)


def test_the_counts_see_what_they_count(tiny_pair):
    """The mode counts a weight's conversion, a logits conversion and a scalar read: the
    assertions above can fail."""
    target_dir, _, _ = tiny_pair
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    mode = Conversions(weights, model.config.vocab_size)
    with mode:
        model.lm_head.weight.float()
        torch.zeros(2, model.config.vocab_size, dtype=torch.bfloat16).float()
        int(torch.ones(3).sum())
    assert mode.counts == {"weight": 1, "engine_logits": 1, "scalar_reads_elsewhere": 1}
