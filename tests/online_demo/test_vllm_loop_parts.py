"""The parts of the online loop behind vLLM that need no vLLM (online_demo/vllm_loop.py,
vllm_report.py): the scraper's windows and its trigger read from a Prometheus page served
over HTTP, the figures around the shift, and the converter's snapshot of complete lines."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specdistill.online_demo.vllm_loop import Scraper
from specdistill.online_demo.vllm_report import pool, shift_figures
from tests.eval.metrics_pages import page


@pytest.fixture
def metrics_server():
    """(url, set_page): a server whose /metrics answers the page last set."""
    state = {"page": page(0, (0, 0, 0), 0)}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # noqa: N802
            body = state["page"].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", lambda p: state.update(page=p)
    server.shutdown()


def test_a_drop_in_served_acceptance_asks_for_a_refresh(metrics_server, tmp_path):
    url, set_page = metrics_server
    asked = []
    scraper = Scraper(tmp_path / "served.jsonl", lambda: asked.append(1), drop=0.1, trailing=2)
    assert scraper.read(url) is None  # the first reading is the baseline
    drafts, accepted = 0, [0, 0, 0]
    for per_round in [(0.8, 0.6, 0.4)] * 3 + [(0.3, 0.1, 0.0)] + [(0.3, 0.1, 0.0)]:
        drafts += 100
        accepted = [a + round(100 * p) for a, p in zip(accepted, per_round, strict=True)]
        set_page(page(drafts, accepted, 4 * drafts))
        scraper.read(url)
    fired = [w["triggered"] for w in scraper.windows]
    assert fired == [False, False, False, True, False]  # once, then a new level is learnt
    assert asked == [1]
    logged = [json.loads(x) for x in (tmp_path / "served.jsonl").read_text().splitlines()]
    assert [w["drafts"] for w in logged] == [100] * 5
    assert logged[0]["per_position"] == [0.8, 0.6, 0.4]


def test_a_window_with_few_rounds_never_triggers(metrics_server, tmp_path):
    url, set_page = metrics_server
    asked = []
    scraper = Scraper(tmp_path / "s.jsonl", lambda: asked.append(1), trailing=1, min_rounds=20)
    scraper.read(url)
    set_page(page(100, (80, 60, 40), 400))
    scraper.read(url)
    set_page(page(105, (80, 60, 40), 420))  # five rounds, none accepted
    scraper.read(url)
    assert asked == [] and len(scraper.windows) == 2


def test_an_engine_that_does_not_answer_is_counted_not_raised(tmp_path):
    scraper = Scraper(tmp_path / "s.jsonl")
    assert scraper.read("http://127.0.0.1:9") is None and scraper.errors == 1


def window(end: float, drafts: int, accepted: int) -> dict:
    return {
        "start": end - 10,
        "end": end,
        "drafts": drafts,
        "draft_tokens": 3 * drafts,
        "accepted": accepted,
        "generated": drafts + accepted,
        "accepted_per_position": [accepted, 0, 0],
    }


def test_the_figures_around_the_shift_pool_their_windows():
    windows = [window(10, 100, 150), window(20, 100, 150)]  # phase 1
    windows += [window(40, 100, 50), window(60, 100, 140)]  # phase 2, the redeploy at 50
    windows += [window(90, 100, 150)]  # phase 3
    deployments = [{"event": "started", "time": 0}, {"event": "deployed", "switched": 50.0}]
    f = shift_figures(windows, [0.0, 30.0, 70.0], 100.0, deployments)
    assert f["before_shift"]["rounds"] == 200 and f["before_shift"]["mean_accepted_length"] == 2.5
    assert f["after_shift"]["mean_accepted_length"] == 1.5
    assert f["after_redeploy"]["mean_accepted_length"] == pytest.approx(2.4)
    assert f["first_redeploy_after_shift_s"] == 20.0 and f["redeploys"] == 1
    assert f["recovery_ratio"] == pytest.approx(
        f["after_redeploy"]["alpha"] / f["before_shift"]["alpha"]
    )
    assert f["return_change"] == pytest.approx(0.0, abs=1e-12)


def test_without_a_redeploy_in_the_shift_nothing_is_called_recovered():
    f = shift_figures([window(40, 100, 50)], [0.0, 30.0, 70.0], 100.0, [])
    assert f["after_redeploy"]["rounds"] == 0 and f["recovery_ratio"] is None
    assert pool([]).alpha is None


def test_recovery_is_the_first_span_of_windows_back_at_95_percent():
    windows = [window(10, 100, 150), window(20, 100, 150)]  # before: τ 2.5
    shifted = [50, 60, 140, 150, 150, 150]  # accepted per 100 rounds, from t = 40
    windows += [window(40 + 10 * i, 100, a) for i, a in enumerate(shifted)]
    deployments = [{"event": "deployed", "switched": t} for t in (55.0, 75.0, 85.0)]
    f = shift_figures(windows, [0.0, 30.0, 200.0], 210.0, deployments)
    first = f["first_version_after_shift"]  # the windows ending in (55, 75]: at 60 and 70
    assert first["windows"] == 2 and first["mean_accepted_length"] == pytest.approx(2.45)
    # pooled over 3 windows, (140, 150, 150) is the first back at 95% of the level: it ends
    # at t = 80, 50 s after the shift, after the redeploys at 55 and 75
    assert f["recovery"] == {"seconds": pytest.approx(50.0), "redeploys": 2}
