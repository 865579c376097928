"""A draft whose weights hold a NaN or an infinity (what a diverged training run writes) is
refused by every loader, with one line naming the weights file and the first bad tensor:
`--draft` (speculate / serve: drafts.loader.load_draft), hot swap, and export."""

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdistill.drafts.acceptance_head import (
    WEIGHTS as HEAD_WEIGHTS,
)
from specdistill.drafts.acceptance_head import (
    AcceptanceHead,
    AcceptanceHeadConfig,
    save_acceptance_head,
)
from specdistill.drafts.loader import load_draft
from specdistill.models.hub import NonFiniteWeightsError, load_tokenizer
from specdistill.models.weights import check_finite
from specdistill.publish import atomic_write_text
from specdistill.train.export_cli import main as export_main
from tests.train.helpers import one_line_error

BAD = "model.layers.0.mlp.up_proj.weight"


def poisoned(source: Path, out: Path, value: float = math.nan, name: str = BAD) -> Path:
    """A copy of the draft directory `source` with one entry of tensor `name` set to `value`."""
    shutil.copytree(source, out)
    weights = out / "model.safetensors"
    state = load_file(weights)
    state[name][0, 0] = value
    save_file(state, weights, metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_draft_with_non_finite_weights_is_refused_naming_file_and_tensor(
    tiny_pair, tmp_path, value
):
    draft = poisoned(tiny_pair[1], tmp_path / "nan", value)
    with pytest.raises(NonFiniteWeightsError) as error:
        load_draft(str(draft))
    message = str(error.value)
    assert "\n" not in message and isinstance(error.value, ValueError)
    assert f"{draft / 'model.safetensors'}: tensor {BAD} (float32)" in message
    assert "NaN or infinite" in message
    load_draft(str(tiny_pair[1]))  # the healthy draft still loads


def test_the_message_counts_every_bad_tensor(tiny_pair, tmp_path):
    draft = poisoned(tiny_pair[1], tmp_path / "one")
    poisoned(draft, tmp_path / "two", name="lm_head.weight")
    with pytest.raises(NonFiniteWeightsError, match=r"and 1 more tensor\(s\)"):
        load_draft(str(tmp_path / "two"))


def test_integer_tensors_and_finite_weights_pass_the_check():
    check_finite("x", [("ids", torch.tensor([1, 2])), ("w", torch.randn(3, 3))])
    with pytest.raises(NonFiniteWeightsError, match="x: tensor w "):
        check_finite("x", [("ids", torch.tensor([1])), ("w", torch.tensor([1.0, math.nan]))])


def test_an_eagle3_head_with_nan_weights_is_refused(tiny_head_dir, tmp_path):
    head = shutil.copytree(tiny_head_dir, tmp_path / "head")
    weights = head / "model.safetensors"
    state = load_file(weights)
    state["fc.weight"][0, 0] = math.nan
    save_file(state, weights)
    with pytest.raises(NonFiniteWeightsError, match=rf"{weights}: tensor fc.weight"):
        load_draft(str(head))


def test_a_nan_acceptance_head_is_refused_naming_its_file(tiny_pair, tmp_path):
    draft = shutil.copytree(tiny_pair[1], tmp_path / "draft")
    head = AcceptanceHead(AcceptanceHeadConfig(hidden_size=16, inner_size=8))
    with torch.no_grad():
        next(head.parameters()).fill_(math.nan)
    save_acceptance_head(head, draft)
    with pytest.raises(NonFiniteWeightsError, match=rf"{draft / HEAD_WEIGHTS}: tensor "):
        load_draft(str(draft))
    assert load_draft(str(draft), use_acceptance_head=False) is not None


def test_serve_refuses_a_nan_draft(tiny_pair, tmp_path):
    from specdistill.serve.options import ServeOptions
    from specdistill.serve.server import Server

    draft = poisoned(tiny_pair[1], tmp_path / "nan")
    with pytest.raises(NonFiniteWeightsError, match=BAD):
        Server(ServeOptions(target=str(tiny_pair[0]), draft=str(draft), gamma=2, max_num_seqs=2))


def test_hot_swap_skips_a_nan_version_and_keeps_serving(tiny_pair, tmp_path):
    from transformers import AutoModelForCausalLM

    from specdistill.serve.drafts import DraftWatcher

    target_dir, draft_dir, _ = tiny_pair
    root = tmp_path / "published"
    for version, value in (("v000001", 0.5), ("v000002", math.nan)):
        poisoned(draft_dir, root / version, value)
        (root / version / "manifest.json").write_text(f'{{"version": "{version}"}}')
    atomic_write_text(root / "current", "v000001\n")
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    watcher = DraftWatcher(
        root,
        target,
        load_tokenizer(str(target_dir)),
        lambda d, v: None,
        poll_s=1.0,
        dtype="float32",
    )
    assert watcher.poll()[1] == "v000001"
    atomic_write_text(root / "current", "v000002\n")
    assert watcher.poll() is None
    assert watcher.loaded == "v000001"  # the old version keeps serving
    assert watcher.failed["v000002"].startswith("NonFiniteWeightsError")
    assert BAD in watcher.failed["v000002"]


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "hf"])
def test_export_refuses_a_nan_draft(tiny_pair, tmp_path, capsys, fmt):
    draft = poisoned(tiny_pair[1], tmp_path / "nan")
    out = tmp_path / "out"
    assert export_main(["--draft", str(draft), "--format", fmt, "--out", str(out)]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert f"{draft / 'model.safetensors'}: tensor {BAD}" in line
    assert not out.exists()


def test_export_refuses_a_nan_eagle3_head(tiny_head_dir, tmp_path, capsys):
    head = shutil.copytree(tiny_head_dir, tmp_path / "head")
    weights = head / "model.safetensors"
    state = load_file(weights)
    state["norm.weight"][0] = math.inf
    save_file(state, weights)
    for fmt in ("vllm", "sglang"):
        out = tmp_path / fmt
        assert export_main(["--draft", str(head), "--format", fmt, "--out", str(out)]) == 2
        assert "tensor norm.weight" in one_line_error(capsys.readouterr().err)
        assert not out.exists()


def test_export_refuses_a_nan_draft_in_memory(tiny_pair, tmp_path):
    from specdistill.train.export import export

    model = load_draft(str(tiny_pair[1]))
    with torch.no_grad():
        model.lm_head.weight[0, 0] = math.nan
    with pytest.raises(NonFiniteWeightsError, match="the draft in memory: tensor lm_head.weight"):
        export(model, "vllm", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_speculate_and_drift_refuse_a_nan_draft_with_one_line(tiny_pair, tmp_path, capsys):
    from specdistill.errors import run_guarded
    from specdistill.eval import drift_cli, speculative

    draft = poisoned(tiny_pair[1], tmp_path / "nan")
    target = str(tiny_pair[0])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f():\\n"}\n')
    common = ["--prompts", str(prompts), "--max-new-tokens", "4", "--device", "cpu"]
    runs = {
        "speculate": (speculative.main, ["--target", target]),
        "drift": (drift_cli.main, ["--target-before", target, "--target-after", target]),
    }
    for verb, (main, models) in runs.items():
        out = tmp_path / verb
        argv = ["--draft", str(draft), *models, *common, "--out", str(out)]
        assert run_guarded(main, argv) == 2, verb
        line = one_line_error(capsys.readouterr().err)
        assert f"{draft / 'model.safetensors'}: tensor {BAD}" in line, verb
