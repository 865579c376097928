"""benchmarks/drift_demo.py's report meta satisfies the drift report's schema (the demo wrote
a meta without prompts, device and dtype, which the schema refuses)."""

import argparse
from pathlib import Path

import torch

from benchmarks.drift_demo import demo_meta
from specdistill.eval.drift_report import DriftMeta


def test_the_demo_meta_is_a_drift_meta():
    args = argparse.Namespace(
        draft="runs/code-4layer/final", base="embedded:code", max_new_tokens=48
    )
    meta = demo_meta(
        args, Path("runs/demo"), Path("runs/demo/prompts_eval.jsonl"), torch.nn.Linear(2, 2)
    )
    parsed = DriftMeta.model_validate(meta)
    assert parsed.dtype == "float32" and parsed.device == "cpu"
    assert parsed.target_after == "embedded:code + runs/demo/adapter"
