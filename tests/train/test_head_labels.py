"""The acceptance head's labels come from the α the draft's loss computes when they are the
same α (one share over every row, the head's temperature and filters): the head loss is then
what computing the labels again gives, and `acceptance_label` does not run; at another
temperature (greedy labels) the head computes its own."""

import pytest
import torch

from specdistill.drafts import acceptance_head as head_module
from specdistill.train.config import load_recipe
from specdistill.train.trainer import Trainer
from tests.train.helpers import overrides


def _trainer(tiny_pair, tmp_path, **extra) -> Trainer:
    extra = {"acceptance_head.enabled": "true", "loss.name": "lk_lambda", **extra}
    return Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, tmp_path, **extra)))


def _head_loss(trainer: Trainer, batch: dict, monkeypatch, reuse: bool) -> tuple[float, int]:
    calls = []
    label = head_module.acceptance_label

    def counted(*args, **kwargs):
        calls.append(1)
        return label(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(head_module, "acceptance_label", counted)
        if not reuse:
            m.setattr(type(trainer.core.head_training), "labels_from", lambda *a: False)
        parts = trainer.core.losses(batch)
    return float(parts.head.loss_sum.detach()), len(calls)


@pytest.mark.parametrize("draft", ["standalone", "reduced"])
def test_labels_from_the_loss_equal_labels_computed_again(tiny_pair, tmp_path, monkeypatch, draft):
    extra = (
        {"draft.model": "target-layers:1", "draft.vocab_size": 100} if draft == "reduced" else {}
    )
    trainer = _trainer(tiny_pair, tmp_path / "run", **extra)
    for batch in trainer.micro_batches(0):
        reused, reused_calls = _head_loss(trainer, batch, monkeypatch, reuse=True)
        again, again_calls = _head_loss(trainer, batch, monkeypatch, reuse=False)
        assert reused == pytest.approx(again, rel=1e-6, abs=1e-6)
        assert reused_calls == 0 and again_calls >= 1


def test_greedy_labels_are_computed_by_the_head(tiny_pair, tmp_path, monkeypatch):
    trainer = _trainer(tiny_pair, tmp_path / "run", **{"eval.temperature": 0})
    batch = trainer.micro_batches(0)[0]
    _, calls = _head_loss(trainer, batch, monkeypatch, reuse=True)
    assert calls >= 1
    assert torch.isfinite(trainer.core.losses(batch).head.loss_sum)
