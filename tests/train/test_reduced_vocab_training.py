"""Distilling a standalone draft made of the target's layers with a reduced output vocabulary
(docs/training.md): the recipe builds it, the run trains it over V_d, and final/ reloads as
the same draft with its map."""

import torch

from specdistill import drafts
from specdistill.drafts import loader
from specdistill.models import hub
from specdistill.train.config import load_recipe
from specdistill.train.trainer import Trainer
from tests.train.helpers import overrides


def test_distill_a_reduced_draft_of_the_targets_layers(tiny_pair, tmp_path):
    out = tmp_path / "run"
    extra = {"draft.model": "target-layers:1", "draft.vocab_size": 100, "train.max_steps": 3}
    result = Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, out, **extra))).run()
    assert 0 < result["alpha"] <= 1
    final = out / "final"
    assert drafts.detect(final) is drafts.ReducedStandalone
    draft = loader.load_draft(str(final))
    target = hub.load_target(str(tiny_pair[0]))
    assert draft.config.num_hidden_layers == 1 and draft.lm_head.weight.shape[0] == 100
    # the layer it was made of was trained, the target's was not
    ours, theirs = draft.model.layers[0].mlp.up_proj.weight, target.model.layers[0].mlp.up_proj
    assert not torch.equal(ours, theirs.weight)


def test_distill_a_reduced_parallel_draft(tiny_pair, tmp_path):
    out = tmp_path / "run"
    extra = {
        "draft.type": "parallel",
        "draft.model": "target-layers:1",
        "draft.vocab_size": 100,
        "draft.parallel_depths": 3,
        "loss.name": "lk_lambda",
        "train.max_steps": 3,
        "eval.every": 3,
    }
    result = Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, out, **extra))).run()
    assert 0 < result["alpha"] <= 1
    final = out / "final"
    assert drafts.detect(final) is drafts.ReducedParallel
    draft = loader.load_draft(str(final))
    assert draft.lm_head.weight.shape[0] == 100 and draft.config.pard_token == len(
        hub.load_tokenizer(str(final))
    )
    assert draft.config.parallel_depths == 3
