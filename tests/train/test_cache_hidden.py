"""An EAGLE-3 head's cache built from another engine's pass (`build_cache(hidden_states=...)`,
vLLM's prefill in `specdistill prepare`: eval/vllm_features.py): its features are that pass's
and its log-probabilities come from that pass's last-layer output through the target's final
norm and output head. Here the other engine is a transformers forward of the same target, so
the cache must equal the one the project's own forward builds; an engine that returns the
wrong number of rows fails the build, naming the sequence, and publishes nothing."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from specdistill.drafts.eagle3.features import FeatureCapture
from specdistill.train.config import load_recipe
from specdistill.train.target_cache import CacheError
from specdistill.train.target_cache_build import build_cache
from tests.train.helpers import eagle_overrides

QUIET = {"print": lambda *a: None}


class ForwardStates:
    """`HiddenStates` from a transformers forward: the layers' inputs and the last layer's
    output before the final norm, one sequence at a time; `drop` rows cut from each."""

    description = "a transformers forward (test)"

    def __init__(self, model_dir, layers, drop: int = 0):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.layers, self.drop, self.closed, self.calls = layers, drop, False, []
        self.final = {}
        self.model.model.norm.register_forward_pre_hook(lambda _m, a: self.final.update(h=a[0]))

    def hidden_states(self, sequences):
        self.calls.append(len(sequences))
        out = []
        for ids in sequences:
            with torch.no_grad(), FeatureCapture(self.model, self.layers[:-1]) as capture:
                self.model(torch.tensor([ids]))
            rows = torch.cat([capture.features()[0], self.final["h"][0]], dim=-1)
            out.append(rows[: len(ids) - self.drop])
        return out

    def close(self):
        self.closed = True


def _shards(path):
    return [load_file(p) for p in sorted(path.glob("train-*.safetensors"))]


def test_a_cache_from_another_engines_hidden_states_equals_the_forwards(
    tiny_pair, sharp_target, tmp_path
):
    recipe = load_recipe(None, eagle_overrides(tiny_pair, sharp_target, tmp_path / "run"))
    own = build_cache(recipe, tmp_path / "own", columns="draft", values_dtype="float32", **QUIET)
    engines = []

    def start(layers):
        engines.append(ForwardStates(sharp_target, layers))
        return engines[-1]

    other = build_cache(
        recipe,
        tmp_path / "other",
        columns="draft",
        values_dtype="float32",
        hidden_states=start,
        **QUIET,
    )
    assert engines[0].layers == [0, 1, 2] and engines[0].closed  # the features', the last
    # asked ahead for many batches at once (2 sequences each), every sequence once
    sequences = [split["sequences"] for split in other["splits"].values()]
    assert engines[0].calls == sequences and min(sequences) > 2
    assert other["features"]["engine"] == ForwardStates.description
    assert own["features"]["engine"] == "specdistill"
    assert other["positions"] == own["positions"] > 0
    a, b = _shards(tmp_path / "own"), _shards(tmp_path / "other")
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for name in x:
            torch.testing.assert_close(y[name], x[name], rtol=0, atol=1e-5, msg=name)


def test_an_engine_with_missing_rows_fails_the_build_and_publishes_nothing(
    tiny_pair, sharp_target, tmp_path
):
    recipe = load_recipe(None, eagle_overrides(tiny_pair, sharp_target, tmp_path / "run"))
    engines = []

    def start(layers):
        engines.append(ForwardStates(sharp_target, layers, drop=1))
        return engines[-1]

    with pytest.raises(CacheError, match=r"hidden states of sequence 0 have \d+ rows for its"):
        build_cache(recipe, tmp_path / "out", columns="draft", hidden_states=start, **QUIET)
    assert engines[0].closed
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
