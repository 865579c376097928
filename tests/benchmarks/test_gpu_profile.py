"""benchmarks/gpu_profile.py on the CPU with the tiny pair: it runs for each dtype asked, and its
summary counts what it says it counts."""

import json

from benchmarks import gpu_profile


def test_profile_writes_each_dtype_summary_and_table(tiny_pair, tmp_path):
    target, draft, _ = tiny_pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    out = tmp_path / "out"
    argv = [
        f"--target={target}",
        f"--draft={draft}",
        "--device=cpu",
        "--dtypes=float32,bfloat16",
        f"--prompts={prompts}",
        "--num-prompts=1",
        "--max-new-tokens=8",
        f"--out={out}",
    ]
    assert gpu_profile.main(argv) == 0
    summaries = json.loads((out / "profile.json").read_text())
    assert [s["dtype"] for s in summaries] == ["float32", "bfloat16"]
    assert summaries[0]["gamma4_vs_first_dtype"] == 1.0
    for s in summaries:
        assert s["ms_per_token_gamma4"] > 0 and s["ms_per_token_target_alone"] > 0
        # the KV cache's bookkeeping reads scalars back every round (tests/eval/test_dtype_costs.py)
        assert s["per_token"]["host_reads"] > 0
        assert s["per_token"]["host_device_copies"] == 0  # nothing leaves the CPU
        assert "Name" in (out / f"profile-{s['dtype']}.txt").read_text()
    # a bfloat16 run casts (RMSNorm in float32, logits for sampling); float32 casts fewer
    assert (
        summaries[1]["per_token"]["dtype_conversions"]
        > summaries[0]["per_token"]["dtype_conversions"]
    )
