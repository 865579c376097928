"""A converted registry model (models/registry.py) is checked on every resolve against the
checksums written when it was converted: changed bytes, a missing or replaced file and a
source record that is not an object are one line saying to convert again; a cache that is a
file or a lock that is a directory are one line too, never a traceback."""

import json
import os
from pathlib import Path

import pytest

from specdistill import cli
from specdistill.models import registry
from tests.models.registry_helpers import installed_package, registry_entry


@pytest.fixture
def converted(tmp_path, monkeypatch, tiny_gguf):
    """The tiny GGUF converted into a private cache (from an "installed" package)."""
    gguf_path = tiny_gguf[0]
    installed_package(tmp_path, monkeypatch, gguf_path)
    return Path(registry.resolve("registry:tiny-test"))


def _overwrite_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = (1.5).hex().encode()[:8]  # finite-looking bytes
    path.write_bytes(bytes(data))


def test_changed_weights_are_refused_naming_the_remedy(converted):
    record = json.loads((converted / "specdistill_source.json").read_text())
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(record["files"])
    assert registry.resolve("registry:tiny-test") == str(converted)  # intact: accepted
    _overwrite_middle(converted / "model.safetensors")
    with pytest.raises(registry.RegistryError) as info:
        registry.resolve("registry:tiny-test")
    message = str(info.value)
    assert "model.safetensors does not match its sha256" in message
    assert f"re-convert it (delete {converted};" in message and "\n" not in message


@pytest.mark.parametrize("damage", ["config.json", "tokenizer.json", "model.safetensors"])
def test_a_missing_or_truncated_file_is_one_line(converted, capsys, damage):
    path = converted / damage
    path.write_bytes(path.read_bytes()[:10])
    prompts = converted.parent / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f():"}\n')
    argv = ["speculate", "--target", "registry:tiny-test", "--draft", str(converted)]
    assert cli.main([*argv, "--prompts", str(prompts), "--out", str(converted.parent / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{damage} changed size" in err and "Traceback" not in err
    path.unlink()
    if damage == "config.json":  # no model directory at all: converted again
        assert registry.resolve("registry:tiny-test") == str(converted) and path.is_file()
        return
    with pytest.raises(registry.RegistryError, match=f"{damage} is missing"):
        registry.resolve("registry:tiny-test")


def test_a_source_record_that_is_no_object_converts_again(converted):
    (converted / "specdistill_source.json").write_text("[]")
    assert registry.resolve("registry:tiny-test") == str(converted)  # not current: rebuilt
    assert isinstance(json.loads((converted / "specdistill_source.json").read_text()), dict)


def test_a_cache_that_is_a_file_or_a_lock_that_is_a_directory_is_one_line(
    tmp_path, monkeypatch, tiny_gguf
):
    from specdistill.errors import ANTICIPATED

    monkeypatch.setitem(registry.REGISTRY, "tiny-test", registry_entry(tiny_gguf[0]))
    cache = tmp_path / "cache"
    cache.write_text("a file")
    monkeypatch.setenv("SPECDISTILL_CACHE", str(cache))
    with pytest.raises(ANTICIPATED, match="cannot take the lock"):
        registry.resolve("registry:tiny-test")
    os.unlink(cache)
    (cache / "registry" / ".lock").mkdir(parents=True)
    with pytest.raises(ANTICIPATED, match="cannot take the lock"):
        registry.resolve("registry:tiny-test")
    (cache / "registry" / ".lock").rmdir()
    (cache / "registry" / "tiny-test").write_text("a file")
    with pytest.raises(registry.RegistryError, match="is a file where the converted"):
        registry.resolve("registry:tiny-test")
