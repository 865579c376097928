"""Fixtures shared by the training tests."""

import pytest

from tests.helpers import save_sharp_target


@pytest.fixture(scope="module")
def sharp_target(tiny_pair, tmp_path_factory):
    """The tiny pair's tokenizer on a target with peaked, context-dependent distributions (a
    default-init random target is near uniform, leaving a head nothing to learn)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    path = tmp_path_factory.mktemp("sharp_target")
    return save_sharp_target(tokenizer, path, hidden=32, layers=2)
