"""Served acceptance read from vLLM's Prometheus page (eval/served_metrics.py): the counters
parsed from the text vLLM 0.32 writes, the window between two readings, a restart, and the
scraper's trigger (specdistill/online_demo/vllm_loop.py)."""

import pytest

from specdistill.eval.served_metrics import (
    MetricsError,
    ServedCounters,
    ServedWindow,
    parse,
)
from specdistill.eval.stats import alpha_from_counts, tau_iid
from tests.eval.metrics_pages import page


def test_the_counters_are_read_from_vllms_page():
    c = parse(page(10, (8, 6, 3), 57), at=5.0)
    assert (c.drafts, c.draft_tokens, c.accepted, c.generated) == (10, 30, 17, 57)
    assert c.per_position == [8, 6, 3] and c.time == 5.0


def test_a_page_without_speculation_reads_zero():
    c = parse("# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total 12.0\n")
    assert (c.drafts, c.accepted, c.generated, c.per_position) == (0, 0, 12, [])
    window = ServedWindow.between(ServedCounters(time=0.0), c)
    assert window.alpha is None and window.mean_accepted_length is None


def test_a_page_that_is_not_prometheus_is_an_error():
    with pytest.raises(MetricsError, match="Prometheus"):
        parse("vllm:x{ 1 2 3\n")


def test_a_window_is_the_difference_of_two_readings():
    before = parse(page(10, (8, 6, 3), 57), at=100.0)
    after = parse(page(30, (26, 20, 12), 157), at=110.0)
    w = ServedWindow.between(before, after)
    assert (w.drafts, w.draft_tokens, w.accepted, w.generated) == (20, 60, 41, 100)
    assert w.per_position == [18 / 20, 14 / 20, 9 / 20]
    assert w.mean_accepted_length == pytest.approx(1 + 41 / 20)
    assert w.tokens_per_s == pytest.approx(10.0)
    assert w.alpha == pytest.approx(alpha_from_counts(20, 60, 41))
    assert tau_iid(w.alpha, 3) == pytest.approx(w.mean_accepted_length, rel=1e-4)


def test_a_restarted_server_is_counted_from_zero():
    before = parse(page(30, (26, 20, 12), 157), at=100.0)
    after = parse(page(5, (4, 3, 1), 20), at=110.0)
    w = ServedWindow.between(before, after)
    assert (w.drafts, w.accepted, w.generated) == (5, 8, 20)
