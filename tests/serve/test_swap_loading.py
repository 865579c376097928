"""Hot swap loads all or nothing: a published version whose weights do not cover its config
is skipped (logged, not served) and the previous version keeps serving."""

import logging
import shutil

import pytest
import torch

from specdistill.models.hub import IncompleteDraftError, load_tokenizer
from specdistill.publish import atomic_write_text
from specdistill.serve.drafts import DraftWatcher
from tests.train.helpers import seven_layer_config


def test_hot_swap_skips_a_version_whose_weights_do_not_cover_its_config(
    tiny_pair, published, tmp_path, caplog
):
    from transformers import AutoModelForCausalLM

    target_dir, draft_dir, _ = tiny_pair
    root = shutil.copytree(published, tmp_path / "published")
    seven_layer_config(draft_dir, root / "v000004")  # 7-layer config, 1-layer weights
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    installed = []
    watcher = DraftWatcher(
        root,
        target,
        load_tokenizer(str(target_dir)),
        lambda d, v: installed.append((d, v)),
        poll_s=1.0,
        dtype="float32",
    )

    found = watcher.poll()  # current -> v000001
    assert found is not None and found[1] == "v000001"
    atomic_write_text(root / "current", "v000004\n")
    with caplog.at_level(logging.ERROR, logger="specdistill.serve"):
        assert watcher.poll() is None
    assert watcher.loaded == "v000001"  # the old version keeps serving
    why = watcher.failed["v000004"]
    assert why.startswith("IncompleteDraftError") and "54 tensors missing" in why
    assert "model.layers.1." in why
    assert "v000004 skipped" in caplog.text and "still serving v000001" in caplog.text
    assert watcher.poll() is None  # not retried while current still names it

    atomic_write_text(root / "current", "v000002\n")  # the next good version swaps in
    draft, version = watcher.poll()
    assert version == "v000002" and watcher.loaded == "v000002"
    assert isinstance(draft.model.layers[0].mlp.up_proj.weight, torch.Tensor)


def test_serve_refuses_a_draft_whose_weights_do_not_cover_its_config(tiny_pair, tmp_path):
    from specdistill.serve.options import ServeOptions
    from specdistill.serve.server import Server

    broken = seven_layer_config(tiny_pair[1], tmp_path / "seven")
    with pytest.raises(IncompleteDraftError, match="54 tensors missing"):
        Server(ServeOptions(target=str(tiny_pair[0]), draft=str(broken), gamma=2, max_num_seqs=2))
