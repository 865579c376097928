"""The data tests' tokenizer fixture (tests/data/helpers.py builds it)."""

import pytest
from transformers import PreTrainedTokenizerFast

from tests.data.helpers import make_tokenizer


@pytest.fixture
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE, vocab 300, `<|endoftext|>` as eos/pad, ChatML chat template."""
    return make_tokenizer()
