"""Session fixtures shared by every test folder: a tiny target/draft pair saved as ordinary
Hugging Face directories (loaded through the same `from_pretrained` path as real models), a
draft of another tokenizer, a peft adapter on the tiny target, an EAGLE-3 head on it (one
per module); and one intra-op thread.

Plain helpers (`make_tokenizer`, `make_model`, ...) are in tests/helpers.py. Marked here: the
heavy tests (tests/heavy.py), and the engine's tests, which run with deprecation warnings as
errors (an argument transformers or peft deprecated fails them before the release that
removes it).
"""

import pytest
import torch

from tests.heavy import mark_heavy
from tests.helpers import TEXT, make_lora_adapter, make_model, make_tokenizer

# The tests that decode through the engine's streams (plain, EAGLE-3 and peft-wrapped models).
STRICT_WARNINGS = (
    "tests/models/test_internals.py",
    "tests/models/test_lean.py",
    "tests/eval/test_drift.py",
    "tests/eval/test_engine_rows.py",
    "tests/eval/test_reduced_vocab_engine.py",
    "tests/eval/test_speculative.py",
    "tests/eval/test_speculative_eagle3.py",
    "tests/serve/test_adapter.py",
    "tests/train/online/test_adapter.py",
)
STRICT = pytest.mark.filterwarnings(
    "error::DeprecationWarning",
    "error::FutureWarning",
    # peft reads this deprecated alias when it wraps a model (not this project's call; the
    # transformers pin stays below the release that removes it)
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning",
)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the marks added here
def pytest_collection_modifyitems(config, items):
    mark_heavy(items)
    for item in items:
        if item.nodeid.partition("::")[0] in STRICT_WARNINGS:
            item.add_marker(STRICT)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny models gain nothing from intra-op threads; on a busy shared CPU the thread barrier
    makes every op ~100× slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_dir, draft_dir, data_dir): models of the same tokenizer; 24 small text files."""
    root = tmp_path_factory.mktemp("tiny_pair")
    tokenizer = make_tokenizer()
    for name, hidden, layers, seed in (("target", 32, 2, 1), ("draft", 16, 1, 2)):
        model = make_model(tokenizer, hidden=hidden, layers=layers, seed=seed)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    data = root / "data"
    data.mkdir()
    for i in range(24):
        (data / f"f{i:02d}.py").write_text(TEXT[i % len(TEXT)] * (1 + i % 3) + f"# file {i}\n")
    return root / "target", root / "draft", data


@pytest.fixture(scope="session")
def other_tokenizer_draft(tmp_path_factory):
    """A draft whose tokenizer was trained on different text: same size, different ids."""
    root = tmp_path_factory.mktemp("other_draft")
    tokenizer = make_tokenizer(
        corpus=["SELECT * FROM t WHERE x = 1;\n", "<html><body></body></html>\n"]
    )
    model = make_model(tokenizer, hidden=16, layers=1, seed=3)
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


@pytest.fixture(scope="session")
def tiny_adapter(tiny_pair, tmp_path_factory):
    """A peft LoRA adapter on the tiny target (a "fine-tune" of it), built with peft here."""
    return make_lora_adapter(
        tiny_pair[0], tmp_path_factory.mktemp("tiny_adapter") / "adapter", scale=3.0
    )


@pytest.fixture(scope="module")
def tiny_head_dir(tiny_pair, tmp_path_factory):
    """An EAGLE-3 head on the tiny target (V_d 100 of the target's vocabulary), saved."""
    from transformers import LlamaForCausalLM

    from specdistill.drafts.eagle3.head import Eagle3Head, build_vocab_map

    target = LlamaForCausalLM.from_pretrained(tiny_pair[0])
    torch.manual_seed(0)
    head = Eagle3Head.from_target(target, draft_vocab_size=100, aux_layers=[0, 1])
    vocab = target.config.vocab_size
    d2t, t2d = build_vocab_map(torch.randint(0, 1000, (vocab,)), 100)
    head.set_vocab_map(d2t, t2d, target.get_output_embeddings().weight)
    path = tmp_path_factory.mktemp("head")
    head.save_pretrained(path, verifier=str(tiny_pair[0]), verifier_arch=["LlamaForCausalLM"])
    return path


@pytest.fixture
def draft_registry():
    """The draft type registry (drafts/registry.py), as it was before the test once it ends:
    a test registers a type of its own with `draft_registry.register(priority)(cls)`."""
    from specdistill.drafts import registry

    types, order = dict(registry.TYPES), list(registry.ORDER)
    yield registry
    registry.TYPES.clear()
    registry.TYPES.update(types)
    registry.ORDER[:] = order
