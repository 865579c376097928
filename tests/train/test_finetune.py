"""train/finetune.py: an SFT LoRA adapter on chat records learns their answers (the loss on
the assistant's tokens falls), loads on the base as a target, and its merged target computes
what base + adapter computes."""

import json

import pytest
import torch

from specdistill.errors import UserError
from specdistill.models import hub
from specdistill.train.finetune import merge_adapter, sft_adapter


def _records(path, n=6):
    rows = [
        {"messages": [{"role": "user", "content": f"say item {i}"},
                      {"role": "assistant", "content": f"- item {i}\n- done"}]}
        for i in range(n)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_sft_learns_the_answers_and_the_merged_target_matches(tiny_pair, tmp_path):
    target_dir = str(tiny_pair[0])
    records = _records(tmp_path / "sft.jsonl")
    torch.manual_seed(0)  # the LoRA's initialisation
    result = sft_adapter(target_dir, tmp_path / "adapter", records, 30, batch_size=4, lr=3e-2)
    # the tiny target's logits are small (init std 0.02): its loss cannot fall far
    assert result["steps"] == 30 and result["loss_last"] < result["loss_first"] - 0.2
    after = hub.load_target(target_dir, str(tmp_path / "adapter")).eval()
    before = hub.load_target(target_dir).eval()
    merged = hub.load_target(str(merge_adapter(target_dir, tmp_path / "adapter", tmp_path / "m")))
    ids = torch.tensor([[5, 17, 42, 9, 100, 3]])
    with torch.no_grad():
        a, b, m = (model(input_ids=ids).logits for model in (after, before, merged.eval()))
    assert not torch.allclose(a, b, atol=1e-3)  # the fine-tune moved the target
    torch.testing.assert_close(m, a, atol=1e-4, rtol=1e-4)


def test_sft_refuses_records_without_answers_and_zero_steps(tiny_pair, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(UserError):
        sft_adapter(str(tiny_pair[0]), tmp_path / "a", str(path), 2)
    with pytest.raises(UserError, match="at least one step"):
        sft_adapter(str(tiny_pair[0]), tmp_path / "b", _records(tmp_path / "ok.jsonl"), 0)
