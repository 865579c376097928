"""Loads in two threads of one process must not leave weight tying switched off.

transformers swaps `PreTrainedModel.tie_weights` for a no-op during `from_pretrained` and
puts back what it saw on entry, so two overlapping loads can put the no-op back for good
(models/model_lock.py). Every model built afterwards then has an untied, random lm_head.
"""

import threading

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from specdistill.models import hub, model_lock


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    out = tmp_path_factory.mktemp("tied")
    LlamaForCausalLM(config).save_pretrained(out)
    return str(out)


def _load_in_threads(path, n_threads=3, loads=12):
    loaded, errors = [], []

    def work():
        try:
            for _ in range(loads):
                loaded.append(hub.load_model(path))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return loaded


def test_concurrent_loads_keep_weight_tying(tied_model_dir):
    original = model_lock._TIE_WEIGHTS
    try:
        loaded = _load_in_threads(tied_model_dir)
        assert PreTrainedModel.tie_weights is original
        assert all(m.lm_head.weight is m.model.embed_tokens.weight for m in loaded)
        torch.manual_seed(0)
        built = LlamaForCausalLM(loaded[0].config)
        assert built.lm_head.weight is built.model.embed_tokens.weight
    finally:
        PreTrainedModel.tie_weights = original


def test_a_load_restores_tying_that_an_outside_load_left_off(tied_model_dir):
    original = model_lock._TIE_WEIGHTS
    try:
        PreTrainedModel.tie_weights = lambda *args, **kwargs: None  # what the race leaves
        model = hub.load_model(tied_model_dir)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert PreTrainedModel.tie_weights is original
    finally:
        PreTrainedModel.tie_weights = original
