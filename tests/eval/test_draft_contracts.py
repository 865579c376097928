"""Typed contracts of the drafts layer and the engine: the `DraftType` / `Drafter`
protocols, the one vocabulary rule (`drafts.compared_vocab_size`), one `RowState` per
request, and the report.json schemas."""

import dataclasses
import json
import math

import pytest
import torch
from pydantic import ValidationError

from specdistill import drafts
from specdistill.drafts import Eagle3, Parallel, Standalone
from specdistill.drafts.eagle3.head import Eagle3Head
from specdistill.drafts.types import Drafter, DraftType
from specdistill.eval.drift_report import DriftReport
from specdistill.eval.engine import Engine, RowState, Sampling
from specdistill.eval.report import SpeculateReport
from tests.eval.helpers import perturbed, tiny_llama

# What the trainer, the engine, the server, the offline α and the export call on a type.
DRAFT_TYPE_MEMBERS = {
    "name",
    "capabilities",
    "layout",
    "exports",
    "per_depth_alpha",
    "own_tokenizer",
    "vocab_size",
    "d2t",
    "detect",
    "detect_loaded",
    "load",
    "meta_model",
    "chains",
    "planned",
    "build",
    "count_mask",
    "depths",
    "head_hidden",
    "save",
    "vocab_size_of",
    "drafter",
    "path_logits",
    "feature_layers",
    "stored_depths",
    "draft_ids",
}
DRAFTER_MEMBERS = {"target_first_token", "capture", "admit", "propose", "commit", "select_rows"}


def _protocol_members(protocol) -> set[str]:
    names = {n for n in vars(protocol) if not n.startswith("_")}
    return (names | set(protocol.__annotations__)) - {"register"}


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(0, vocab=96, hidden=32, layers=2, init=0.2)
    draft = perturbed(target, 0.02, seed=1)
    torch.manual_seed(0)
    head = Eagle3Head.from_target(target, draft_vocab_size=64, aux_layers=[0, 1, 1])
    return target, draft, head


def test_the_protocols_list_what_callers_use():
    assert _protocol_members(DraftType) == DRAFT_TYPE_MEMBERS
    assert _protocol_members(Drafter) == DRAFTER_MEMBERS


def test_every_draft_type_satisfies_the_protocol(models):
    target, draft, head = models
    kinds = [Standalone(96), Eagle3(head, steps=2, vocab_size=96), Parallel(96, 3, 96)]
    for kind in kinds:
        assert isinstance(kind, DraftType), type(kind).__name__
        assert all(hasattr(kind, name) for name in DRAFT_TYPE_MEMBERS)
    assert kinds[1].d2t is not None and kinds[0].d2t is None  # V_d 64 < V 96
    assert set(drafts.TYPES.values()) == {Standalone, Eagle3, Parallel}
    for model in (draft, head):
        kind = drafts.type_of(model)
        assert isinstance(kind.drafter(model, 96, torch.device("cpu")), Drafter)
    # A class missing one member is no draft type.
    incomplete = type("Incomplete", (), {n: None for n in DRAFT_TYPE_MEMBERS - {"d2t"}})
    assert not isinstance(incomplete(), DraftType)


def test_the_reduced_vocabulary_variant_is_the_standalone_type(models):
    """A standalone draft with a reduced output head (drafts/standalone/reduced_vocab.py) is a
    variant of the standalone type, not a fourth type: same name, its own V_d map and its own
    way of being exported."""
    from specdistill.drafts import ReducedStandalone
    from specdistill.drafts.standalone.reduced_vocab import with_reduced_head
    from specdistill.drafts.vocab_map import build_vocab_map

    target, draft, _ = models
    d2t, t2d = build_vocab_map(torch.arange(96), 64)
    reduced = with_reduced_head(draft, d2t, t2d)
    kind = ReducedStandalone(96, reduced.lm_head)
    assert isinstance(kind, DraftType) and isinstance(kind, Standalone)
    assert kind.name == "standalone" and kind.d2t is reduced.d2t
    assert kind.capabilities.export_as == "reduced_causal_lm"
    assert kind.exports is not Standalone.exports
    assert drafts.type_of(reduced) is ReducedStandalone
    assert isinstance(drafts.drafter_for(reduced, 96, torch.device("cpu")), Drafter)
    assert drafts.compared_vocab_size(target, draft=reduced) == 96  # its V, not its V_d


def test_the_standalone_type_is_frozen():
    kind = Standalone(96)
    with pytest.raises(dataclasses.FrozenInstanceError):
        kind.vocab_size = 95


def test_one_vocabulary_rule(models):
    target, draft, head = models
    small = tiny_llama(2, vocab=80, hidden=32, layers=1, init=0.2)
    assert drafts.compared_vocab_size(target) == 96
    assert drafts.compared_vocab_size(target, draft=draft) == 96
    assert drafts.compared_vocab_size(target, draft=small) == 80
    assert drafts.compared_vocab_size(small, target, draft=draft) == 80
    # An EAGLE-3 head counts with its target vocabulary V, not its V_d.
    assert drafts.compared_vocab_size(target, draft=head) == 96
    assert Engine(target, small, gamma=2).vocab_size == 80
    with pytest.raises(ValueError, match="at least one target"):
        drafts.compared_vocab_size(draft=draft)


def test_each_request_is_one_row_state_dropped_when_forgotten(models):
    target, draft, _ = models
    engine = Engine(target, draft, gamma=2, capacity=2)
    a = engine.add([1, 2, 3], max_new_tokens=30, sampling=Sampling(0.8, seed=3), logprobs=1)
    b = engine.add([4, 5], max_new_tokens=3)
    rows = engine.batch.rows
    assert isinstance(rows[a], RowState) and rows[a].sampling.seed == 3
    assert rows[a].generator is not None and rows[b].generator is None
    engine.step()
    assert rows[a].admitted_at > 0 and len(rows[a].outputs) >= 1
    engine.cancel(a)
    assert a not in rows
    while engine.busy:
        engine.step()
    engine.step()  # the last finished request is forgotten at the next step
    assert rows == {} and engine.batch.requests == []


def _drift_report() -> dict:
    interval = {"before": 0.5, "after": 0.4, "drop": 0.1}
    cis = {"before_ci": [0.4, 0.6], "after_ci": [0.3, 0.5], "drop_ci": [0.05, 0.15]}
    return {
        **{f"alpha_{k}": v for k, v in interval.items()},
        **{f"alpha_{k}": v for k, v in cis.items()},
        **{f"alpha_greedy_{k}": v for k, v in interval.items()},
        "alpha_greedy_drop_ci": cis["drop_ci"],  # in summarise's order
        "alpha_greedy_before_ci": cis["before_ci"],
        "alpha_greedy_after_ci": cis["after_ci"],
        "alpha_before_on_after_text": 0.45,
        "alpha_greedy_before_on_after_text": 0.45,
        "target_tv": math.nan,
        "target_argmax_disagreement": 0.0,
        "tau_before": {1: 1.5, 2: 1.75},
        "tau_after": {1: 1.4, 2: 1.56},
        "tau_greedy_before": {},
        "tau_greedy_after": {},
        "per_category": {
            "code": {"n": 12, **interval, **cis, "insufficient": False, "greedy": interval | cis},
            "loops": {"n": 2, "insufficient": True, "min_samples": 10},
        },
        "n_prompts": 14,
        "n_positions_before": 100,
        "n_positions_after": 90,
        "verdict": {
            "refit_recommended": True,
            "threshold": 0.02,
            "drop": 0.1,
            "drop_ci": [0.05, 0.15],
            "reason": "r",
        },
        "drop_from_text": 0.05,
        "drop_from_target": 0.05,
        "temperature": 1.0,
        "draft_type": "standalone",
    }


def test_the_drift_report_writes_its_keys_as_given_and_reads_back(tmp_path):
    report = _drift_report()
    DriftReport.model_validate(report).write_json(tmp_path / "report.json")
    text = (tmp_path / "report.json").read_text()
    assert text == json.dumps(report, indent=2, default=str) + "\n"
    back = DriftReport.read(tmp_path / "report.json")
    assert back.per_category["loops"].insufficient and back.tau_before == {1: 1.5, 2: 1.75}
    assert back.per_depth is None and back.meta is None
    with pytest.raises(ValidationError, match="alpha_befor"):
        DriftReport.model_validate({**report, "alpha_befor": 0.5})
    missing = dict(report)
    del missing["verdict"]
    with pytest.raises(ValidationError, match="verdict"):
        DriftReport.model_validate(missing)


def test_the_speculate_report_schema_rejects_unknown_keys():
    stats = {"p50": 0.1, "p95": 0.2, "p99": math.nan, "mean": 0.1}
    decode = {
        "tokens": 10,
        "wall_s": 1.0,
        "tokens_per_s": 10.0,
        "requests_per_s": 1.0,
        "ttft_s": stats,
        "token_latency_s": stats,
        "request_latency_s": stats,
        "queue_s": stats,
        "rounds": 5,
        "verify_s_per_round": math.nan,
        "prefill_s": 0.1,
    }
    result = {
        "settings": {"gammas": [2], "temperatures": (0.0,)},
        "tau_tolerance": 0.1,
        "baselines": {"0": {"name": "T=0 target-only", **decode}},
        "configs": [],
        "best_gamma": {},
    }
    report = SpeculateReport.of(result)
    data = json.loads(report.to_json())
    assert list(data) == ["settings", "tau_tolerance", "baselines", "configs", "best_gamma"]
    assert list(data["baselines"]["0"])[:2] == ["name", "tokens"]
    assert data["baselines"]["0"]["verify_s_per_round"] is None  # NaN -> null
    assert data["settings"]["temperatures"] == [0.0] and data["settings"]["repeats"] == 1
    with pytest.raises(ValidationError, match="tokens_per_sec"):
        SpeculateReport.of(
            {**result, "baselines": {"0": {**decode, "name": "x", "tokens_per_sec": 1}}}
        )
