"""What a decoded round costs beyond its arithmetic, per dtype: the engine converts no weight,
reads the device once a round, and converts logits to float32 only where it samples.

Models this small are launch-bound on a GPU, where a conversion of a weight-sized tensor or a
host synchronisation per token costs more than the matrix products. These counts are the same
on the CPU, so they are pinned here, for float32, bfloat16 and float16 alike, and a change that
adds one fails:
- no dtype conversion of a weight, anywhere (inside the models' forwards included);
- one host read per round (the round's accepted counts and tokens, `Tensor.tolist`), no
  `Tensor.item`;
- outside the models' forwards (`KVStream.forward`, lean or transformers'), no conversion of
  logits at T = 0; at T = 1 at most γ + 1 a round: each draft step's logits and the
  verification's, to float32 for sampling.
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from specdistill.drafts import kv_cache
from specdistill.eval.engine import generate

GAMMA = 3
PROMPTS = [[5, 17, 30, 44, 9], [7, 8, 9]]


class Conversions(TorchDispatchMode):
    """Counts dtype conversions (aten.to / _to_copy to another dtype): of `weights`' storages,
    and of logits ([..., vocab_size]) outside the models' forwards."""

    def __init__(self, weights: set[int], vocab_size: int):
        super().__init__()
        self.weights, self.vocab_size = weights, vocab_size
        self.inside_forward = 0
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        source = args[0] if args else None
        if (
            name in ("aten.to", "aten._to_copy")
            and isinstance(out, torch.Tensor)
            and isinstance(source, torch.Tensor)
            and out.dtype != source.dtype
        ):
            if source.untyped_storage().data_ptr() in self.weights:
                self.counts["weight"] += 1
            if not self.inside_forward and source.shape[-1:] == (self.vocab_size,):
                self.counts["engine_logits"] += 1
        return out


def measure(pair, dtype: torch.dtype, temperature: float, monkeypatch) -> tuple[dict, int]:
    """(counts, rounds) of one `generate` of the tiny pair in `dtype`."""
    target_dir, draft_dir, _ = pair
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).eval()
    weights = {p.untyped_storage().data_ptr() for m in (target, draft) for p in m.parameters()}
    mode = Conversions(weights, target.config.vocab_size)

    forward = kv_cache.KVStream.forward

    def counted_forward(stream, *args, **kwargs):
        mode.inside_forward += 1
        try:
            return forward(stream, *args, **kwargs)
        finally:
            mode.inside_forward -= 1

    reads = collections.Counter()
    tolist, item = torch.Tensor.tolist, torch.Tensor.item

    def counted_tolist(t):
        reads["tolist"] += 1
        return tolist(t)

    def counted_item(t):
        reads["item"] += 1
        return item(t)

    generate(target, draft, PROMPTS, gamma=GAMMA, max_new_tokens=4, temperature=temperature)
    monkeypatch.setattr(kv_cache.KVStream, "forward", counted_forward)
    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    monkeypatch.setattr(torch.Tensor, "item", counted_item)
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
    assert counts.get("item", 0) == 0, counts
    logits = counts.get("engine_logits", 0)
    if temperature == 0 or dtype == torch.float32:
        assert logits == 0, counts  # greedy takes the argmax in the model's dtype
    else:
        assert 0 < logits <= (GAMMA + 1) * rounds, (counts, rounds)


def test_the_counts_see_what_they_count(tiny_pair, monkeypatch):
    """The mode counts a weight's conversion, and a patched engine read: the assertions above
    can fail."""
    target_dir, _, _ = tiny_pair
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    mode = Conversions(weights, model.config.vocab_size)
    with mode:
        model.lm_head.weight.float()
        torch.zeros(2, model.config.vocab_size, dtype=torch.bfloat16).float()
    assert mode.counts == {"weight": 1, "engine_logits": 1}
