"""The hot-swap watcher at its edges: an unreadable `current` (not UTF-8, a directory, a
symlink loop) is logged, counted, shown in /health and /metrics and retried, never the end
of the watch; only the drafts root's own versions load; a config of other shapes is refused
from the weights' headers before the model is built."""

import json
import os
import shutil
import time

import pytest

from specdistill.models.hub import load_tokenizer
from specdistill.publish import atomic_write_text
from specdistill.serve.drafts import DraftWatcher


def unreadable(root, how: str) -> None:
    """Make ROOT/current unreadable in the way `how` names."""
    current = root / "current"
    current.unlink()
    if how == "not_utf8":
        current.write_bytes(b"v00000\xff\xfe\n")
    elif how == "directory":
        current.mkdir()
    else:  # a symlink loop
        os.symlink(root / "loop-b", root / "loop-a")
        os.symlink(root / "loop-a", root / "loop-b")
        os.symlink(root / "loop-a", current)


def repair(root) -> None:
    current = root / "current"
    if current.is_dir() and not current.is_symlink():
        current.rmdir()
    else:
        current.unlink()
    atomic_write_text(current, "v000002\n")


def wait_for(predicate, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def tiny_target_model(tiny_pair):
    """The tiny target, loaded."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_pair[0])


@pytest.mark.parametrize("how", ["not_utf8", "directory", "symlink_loop"])
def test_an_unreadable_current_is_retried_and_never_stops_the_watcher(
    tiny_pair, published, tmp_path, tiny_target_model, how, caplog
):
    root = shutil.copytree(published, tmp_path / "published")
    installed = []
    watcher = DraftWatcher(
        root,
        tiny_target_model,
        load_tokenizer(str(tiny_pair[0])),
        lambda d, v: installed.append(v),
        poll_s=0.05,
        dtype="float32",
    )
    assert watcher.poll()[1] == "v000001"
    unreadable(root, how)
    watcher.start()
    try:
        assert wait_for(lambda: watcher.errors >= 3)  # retried at every poll
        health = watcher.health()
        assert not health["ok"] and "cannot read the current version" in health["error"]
        assert watcher.is_alive() and watcher.loaded == "v000001"
        assert caplog.text.count("draft watch poll failed") == 1  # logged once per problem
        repair(root)
        assert wait_for(lambda: installed == ["v000002"])  # the next version still swaps in
        assert watcher.health()["ok"] and watcher.health()["errors"] >= 3
    finally:
        watcher.stop()
        watcher.join(5)


def test_health_and_metrics_show_a_failing_watch(tiny_pair, published, tmp_path):
    from fastapi.testclient import TestClient

    from specdistill.serve.options import ServeOptions
    from specdistill.serve.server import Server

    root = shutil.copytree(published, tmp_path / "published")
    srv = Server(
        ServeOptions(
            target=str(tiny_pair[0]),
            drafts=str(root),
            gamma=2,
            max_num_seqs=2,
            served_model_name="m",
        )
    )
    http = TestClient(srv.app)
    assert http.get("/health").json()["status"] == "ok"
    unreadable(root, "not_utf8")
    srv.watcher.step()
    srv.watcher.step()
    health = http.get("/health").json()
    assert health["status"] == "degraded" and health["draft_version"] == "v000001"
    assert health["drafts"]["errors"] == 2
    assert "cannot read the current version" in health["drafts"]["error"]
    metrics = http.get("/metrics").text
    assert "specdistill:draft_watch_errors_total 2.0" in metrics
    assert "specdistill:draft_watch_failing 1.0" in metrics
    repair(root)
    srv.watcher.step()
    assert http.get("/health").json()["status"] == "ok"
    assert "specdistill:draft_watch_failing 0.0" in http.get("/metrics").text


@pytest.mark.parametrize("how", ["absolute_draft_dir", "relative_draft_dir", "linked_version"])
def test_only_the_roots_own_versions_load(tiny_pair, published, tmp_path, tiny_target_model, how):
    root = shutil.copytree(published, tmp_path / "published")
    outside = shutil.copytree(tiny_pair[1], tmp_path / "outside")
    version = root / "v000005"
    if how == "linked_version":
        os.symlink(outside, version)
        (outside / "manifest.json").write_text('{"version": "v000005"}')
    else:
        version.mkdir()
        draft_dir = str(outside) if how == "absolute_draft_dir" else "../../outside"
        (version / "manifest.json").write_text(json.dumps({"draft_dir": draft_dir}))
    watcher = DraftWatcher(
        root,
        tiny_target_model,
        load_tokenizer(str(tiny_pair[0])),
        lambda d, v: None,
        poll_s=0.05,
        dtype="float32",
    )
    assert watcher.poll()[1] == "v000001"
    atomic_write_text(root / "current", "v000005\n")
    assert watcher.poll() is None and watcher.loaded == "v000001"
    assert watcher.failed["v000005"].startswith("OutsideRootError")
    assert "outside the drafts root" in watcher.failed["v000005"]


def test_a_config_of_other_shapes_is_refused_before_the_model_is_built(
    tiny_pair, published, tmp_path, tiny_target_model, monkeypatch
):
    import specdistill.drafts.checked_load as served

    root = shutil.copytree(published, tmp_path / "published")
    version = shutil.copytree(tiny_pair[1], root / "v000006")
    config = json.loads((version / "config.json").read_text())
    config.update(hidden_size=4096, intermediate_size=11008, num_attention_heads=32)
    config.update(num_key_value_heads=32, head_dim=128)
    (version / "config.json").write_text(json.dumps(config))
    (version / "manifest.json").write_text('{"version": "v000006"}')
    built = []
    real = served.load_draft
    monkeypatch.setattr(served, "load_draft", lambda *a, **k: built.append(a) or real(*a, **k))
    watcher = DraftWatcher(
        root,
        tiny_target_model,
        load_tokenizer(str(tiny_pair[0])),
        lambda d, v: None,
        poll_s=0.05,
        dtype="float32",
    )
    atomic_write_text(root / "current", "v000006\n")
    assert watcher.poll() is None
    why = watcher.failed["v000006"]
    assert why.startswith("IncompleteDraftError") and "of another shape" in why
    assert "4096" in why and built == []  # refused from the headers: nothing was built
    atomic_write_text(root / "current", "v000002\n")
    assert watcher.poll()[1] == "v000002" and len(built) == 1  # a good one still loads
