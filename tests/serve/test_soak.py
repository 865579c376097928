"""The closed loop under good and hostile traffic (benchmarks/soak.py), on the tiny pair.

Slow: two processes (server, online job) and about two minutes of load. Also runnable as
`python -m benchmarks.soak --target DIR --draft DIR ...`. Every check of the benchmark is
asserted here except the p95 latency ratio, which is a timing (the benchmark reports it and
fails on it; a test on a shared CI machine does not).
"""

import pytest

from benchmarks import soak


@pytest.mark.slow
def test_soak_closed_loop_survives_hostile_traffic(tiny_pair, tmp_path):
    target, draft, _ = tiny_pair
    s = soak.Settings(
        target=str(target),
        draft=str(draft),
        clients=4,
        clean_seconds=20,
        minutes=1.0,
        max_tokens=12,
        prompt_chars=40,
        max_num_seqs=4,
        out=str(tmp_path / "soak"),
    )
    figures = soak.run(s)
    soak.print_table(figures, s)
    checks = dict(figures["checks"])
    checks.pop("p95 within the ratio")
    assert all(checks.values()), (checks, figures)
    assert figures["hostile_requests"] > 20 and figures["untrusted_requests"] > 0
    assert figures["poison_rejected"] == figures["poison_records"] > 0
