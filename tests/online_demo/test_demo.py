"""`specdistill online demo` end to end on the tiny pair, with tiny sizes."""

import json


def test_demo_runs_serves_learns_and_reports(tiny_pair, tmp_path, monkeypatch):
    from specdistill.online_demo import cli, demo

    target, draft, data = tiny_pair
    texts = [p.read_text() * 4 for p in sorted(data.glob("*.py"))]
    # the tiny pair's own small files instead of the held-out stdlib split
    monkeypatch.setattr(demo, "code_texts", lambda max_files=None: texts)
    out = tmp_path / "demo"
    argv = [
        "--out", str(out), "--target", str(target), "--draft", str(draft),
        "--phase-seconds", "4,5,4", "--clients", "2", "--max-tokens", "8",
        "--prompt-tokens", "12", "--batch", "4", "--refresh-records", "8",
        "--refresh-steps", "2", "--holdout", "4", "--osd-batch", "4",
        "--eval-sequences", "4", "--eval-tokens", "40", "--loss", "fkl",
        "--threads", "1", "--minutes", "1",
        "--shift", "target", "--ft-steps", "2", "--ft-rank", "2", "--ft-code-files", "2",
        "--fit-steps", "2",
    ]  # fmt: skip
    rc = cli.main(argv)
    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "alpha_before_shift", "alpha_after_shift", "alpha_after_refresh",
        "alpha_original_domain_after", "records_seen", "records_trained",
        "records_rejected", "promotions", "rollbacks", "failed_requests",
        "drop_at_shift", "drop_interval", "recovery_records", "recovery_seconds",
        "recovery_refreshes", "original_domain_change", "windows", "duplicates",
        "over_prompt_cap",
    ):  # fmt: skip
        assert key in summary, key
    assert summary["failed_requests"] == 0, summary["failure_examples"]
    assert summary["records_logged"] == summary["requests_served"] > 0
    assert not summary["job_errors"]
    assert rc == 0
    for policy in ("specdistill", "osd"):
        assert set(summary[policy]["offline_alpha"]) == {"code", "prose"}
        assert all(0 <= a <= 1 for a in summary[policy]["offline_alpha"].values())
    assert 0 < summary["osd"]["records_trained"] <= summary["records_logged"]  # one pass
    assert summary["alpha_before_shift"] is not None
    assert summary["windows"]["before_shift"]["records"] > 0
    assert summary["prompt_pool"]["code"] > len(texts)  # several prompts per text
    assert (out / "served_alpha.png").stat().st_size > 1000
    assert (out / "drafts" / "v000001" / "manifest.json").is_file()
    # --shift target: the server and the job ran the fine-tuned target, the draft was fit first
    assert summary["shift"]["fine_tune"]["steps"] == 2
    assert summary["shift"]["fit"]["steps"] == 2
    adapter = str(out / "target-adapter")
    assert summary["settings"]["target_adapter"] == adapter
    from specdistill.formats.traffic_shards import read_traffic

    records = read_traffic(out / "traffic")
    assert records and all("+adapter:sha256:" in r["target"]["identity"] for r in records)
