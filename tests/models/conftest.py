"""Fixtures of the models tests."""

import pytest

from tests.models.registry_helpers import tiny_model, tiny_tokenizer, write_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(GGUF path, the model it was written from, the tokenizer), written once."""
    folder = tmp_path_factory.mktemp("gguf")
    tok = tiny_tokenizer()
    model = tiny_model(tok.get_vocab_size())
    path = folder / "tiny-test.F32.gguf"
    write_gguf(path, model, tok)
    return path, model, tok
