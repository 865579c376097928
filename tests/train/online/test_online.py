"""The online job on synthetic traffic: screening, refresh, gate, publish, crash safety."""

import json
import random
import subprocess
import sys

import numpy as np
import pytest

from tests.train.online.helpers import job, kept, lines, online_recipe, quiet, write_shard


def test_one_pass_screens_trains_gates_and_publishes(tiny_pair, traffic_pool, tmp_path):
    identity, pool = traffic_pool
    foreign = [
        dict(r, id=f"x-{i}", target={"name": "other", "identity": "sha256:beef"})
        for i, r in enumerate(pool[:5])
    ]
    too_long = dict(pool[0], id="long", completion_token_ids=pool[0]["completion_token_ids"] * 20)
    write_shard(
        tmp_path / "traffic",
        1,
        pool[:30] + foreign,
        [
            b"{not json\n",
            b'{"schema_version": 1}\n',
            json.dumps(too_long).encode() + b"\n",
            b'{"torn": tr',
        ],
    )  # torn final line of a shard followed by another
    write_shard(tmp_path / "traffic", 2, pool[30:60] + [pool[3]])  # a duplicate prompt
    recipe = online_recipe(tiny_pair, tmp_path, min_gain=-1.0)  # promote whatever trains
    summary = job(recipe).run()
    out, root = tmp_path / "out", tmp_path / "drafts"
    assert summary["records_seen"] == 61
    assert summary["duplicates"] == 1
    assert summary["rejected_by_reason"] == {
        "target_identity": 5,
        "malformed_json": 1,
        "schema": 1,
        "oversized": 1,
        "torn_line": 1,
    }
    rejects = lines(out / "rejects.jsonl")
    assert sorted(r["reason"] for r in rejects) == sorted(
        ["target_identity"] * 5 + ["malformed_json", "schema", "oversized", "torn_line"]
    )
    # every accepted record but the held-out newest 12 is trained, once
    assert summary["records_trained"] == 60 - 12
    state = json.loads((out / "state" / "trainer_state.json").read_text())
    assert len(set(state["trained_ids"])) == len(state["trained_ids"]) == 48
    held = {r["id"] for r in state["store"]["holdout"]}
    assert held == {r["id"] for r in pool[48:60]} and not held & set(state["trained_ids"])
    decisions = lines(out / "decisions.jsonl")
    assert len(decisions) == summary["refreshes"] >= 2
    assert all(d["decision"] == "promoted" for d in decisions)
    current = (root / "current").read_text().strip()
    manifest = json.loads((root / current / "manifest.json").read_text())
    assert manifest["version"] == current and manifest["parent"] is not None
    assert manifest["target"]["identity"] == identity
    for key in ("traffic_window", "records_trained", "alpha", "ci", "loss", "time"):
        assert key in manifest
    # the server's loader takes the published version
    from specdistill.models.hub import load_model, load_tokenizer
    from specdistill.serve.drafts import DraftWatcher

    watcher = DraftWatcher(
        root,
        load_model(str(tiny_pair[0])),
        load_tokenizer(str(tiny_pair[0])),
        lambda *a: None,
        poll_s=1.0,
        dtype="float32",
    )
    assert watcher.poll()[1] == current
    # a rerun finds nothing new and changes nothing
    again = job(recipe).run()
    assert again["records_trained"] == 48 and again["refreshes"] == summary["refreshes"]


class Crash(Exception):
    pass


POINTS = [
    "read:line",
    "refresh:step",
    "refresh:gated",
    "publish:saved",
    "publish:manifest",
    "publish:renamed",
    "commit:before",
    "commit:written",
    "commit:after",
]


def test_kill_and_restart_loses_no_record_and_trains_none_twice(tiny_pair, traffic_pool, tmp_path):
    _, pool = traffic_pool
    write_shard(tmp_path / "traffic", 1, pool[:40], [b"{bad\n"])
    write_shard(tmp_path / "traffic", 2, pool[40:72])
    recipe = online_recipe(tiny_pair, tmp_path, min_gain=-1.0, refresh_records=16)
    rng = random.Random(0)
    crashes = 0
    for _attempt in range(40):
        point = rng.choice(POINTS)
        after = rng.randint(1, 30 if "line" in point else 3)
        calls = {"n": 0}

        def hook(p, point=point, after=after, calls=calls):
            if p == point:
                calls["n"] += 1
                if calls["n"] >= after:
                    raise Crash(p)

        try:
            summary = job(recipe, faults=hook).run()
            break
        except Crash:
            crashes += 1
            root = tmp_path / "drafts"
            current = (root / "current").read_text().strip()  # always a complete version
            assert (root / current / "manifest.json").is_file()
    else:
        pytest.fail("the job never finished")
    assert crashes >= 3
    state = json.loads((tmp_path / "out" / "state" / "trainer_state.json").read_text())
    trained = state["trained_ids"]
    assert len(trained) == len(set(trained))  # none twice
    assert set(trained) == {r["id"] for r in pool[: 72 - 12]}  # none lost (12 held out)
    assert summary["records_seen"] == 72 and summary["records_rejected"] == 1
    assert len(lines(tmp_path / "out" / "rejects.jsonl")) == 1  # the log cut back on resume
    decisions = lines(tmp_path / "out" / "decisions.jsonl")
    assert len(decisions) == summary["refreshes"]
    assert not list((tmp_path / "drafts").glob(".tmp-*"))


def test_sigkill_mid_refresh_then_resume(tiny_pair, traffic_pool, tmp_path):
    """A real kill -9 (SIGKILL from the fault point) of the online job's command line, run by
    tests/train/online/fault_runner.py (`specdistill.train.online.job.main` with a fault hook)."""
    import os

    from specdistill.train.config import dump_recipe

    _, pool = traffic_pool
    write_shard(tmp_path / "traffic", 1, pool[:60])
    recipe = online_recipe(tiny_pair, tmp_path, min_gain=-1.0, refresh_records=16)
    dump_recipe(recipe, tmp_path / "r.yaml")
    args = ["--recipe", str(tmp_path / "r.yaml"), "--once"]
    runner = [sys.executable, "-m", "tests.train.online.fault_runner"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run(
        [*runner, "refresh:step:5", *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    state = json.loads((tmp_path / "out" / "state" / "trainer_state.json").read_text())
    assert len(state["trained_ids"]) == 16  # the first refresh was committed, the second not
    done = subprocess.run(
        [sys.executable, "-m", "specdistill.train.online.job", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    state = json.loads((tmp_path / "out" / "state" / "trainer_state.json").read_text())
    assert sorted(state["trained_ids"]) == sorted(r["id"] for r in pool[:48])


@pytest.mark.parametrize("point", ["publish:saved", "publish:manifest", "publish:renamed"])
def test_crashed_publish_never_exposes_a_partial_version(tiny_pair, tmp_path, point):
    from specdistill.drafts.loader import load_draft
    from specdistill.formats.published import Manifest, read_current
    from specdistill.models.hub import load_tokenizer
    from specdistill.train.online import versions as ov

    root = tmp_path / "drafts"
    draft = load_draft(str(tiny_pair[1]))
    tok = load_tokenizer(str(tiny_pair[1]))

    def save(d):
        draft.save_pretrained(d)
        tok.save_pretrained(d)

    assert ov.publish_version(root, save, Manifest()) == "v000001"

    def crash(p):
        if p == point:
            raise Crash(p)

    with pytest.raises(Crash):
        ov.publish_version(root, save, Manifest(), faults=crash)
    assert read_current(root) == "v000001"
    names = {p.name for p in root.iterdir() if p.name.startswith("v")}
    if point == "publish:renamed":  # complete, not yet current: a later publish goes past it
        assert names == {"v000001", "v000002"}
        assert (root / "v000002" / "manifest.json").is_file()
    else:
        assert names == {"v000001"}  # the partial one is only a .tmp-* directory
    assert ov.publish_version(root, save, Manifest()) in ("v000002", "v000003")
    assert not list(root.glob(".tmp-*"))


def test_worse_candidate_is_rejected_and_a_promotion_rolled_back(tiny_pair, traffic_pool, tmp_path):
    import copy

    import torch

    from specdistill.cli import main as cli
    from specdistill.drafts import Standalone
    from specdistill.drafts.loader import load_draft
    from specdistill.formats.published import Manifest
    from specdistill.models.hub import load_model, load_tokenizer
    from specdistill.train.online.gate import decide, sequence_alpha
    from specdistill.train.online.versions import publish_version

    _, pool = traffic_pool
    target = load_model(str(tiny_pair[0]))
    tok = load_tokenizer(str(tiny_pair[0]))
    incumbent = load_draft(str(tiny_pair[1]))
    scrambled = copy.deepcopy(incumbent)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in scrambled.parameters():
            p.copy_(p.flatten()[torch.randperm(p.numel(), generator=g)].view_as(p) * 3)
    held = [kept(r) for r in pool[:40]]
    kind = Standalone(len(tok))
    cfg = online_recipe(tiny_pair, tmp_path).online
    a_inc = sequence_alpha(kind, target, incumbent, held, tok.pad_token_id)
    a_bad = sequence_alpha(kind, target, scrambled, held, tok.pad_token_id)
    a_same = sequence_alpha(kind, target, target, held, tok.pad_token_id)  # the target itself
    cats = [h.category for h in held]
    bad = decide(a_bad, a_inc, cats, cfg)
    assert not bad["promote"] and bad["ci"][0] <= 0, bad
    good = decide(a_same, a_inc, cats, cfg)
    assert good["promote"] and good["ci"][0] > 0 and abs(good["alpha_candidate"] - 1) < 1e-4
    # a category that regresses blocks a promotion even when the mean gains
    mixed = np.where(np.array(cats) == "prose", a_inc - 0.2, a_same)
    blocked = decide(mixed, a_inc, cats, cfg)
    assert not blocked["promote"] and "prose" in blocked["why"]

    # a regressed promotion, rolled back to its parent with the CLI
    root = tmp_path / "drafts"
    for model in (incumbent, scrambled):
        publish_version(
            root, lambda d, m=model: (m.save_pretrained(d), tok.save_pretrained(d)), Manifest()
        )
    assert (root / "current").read_text().strip() == "v000002"
    assert cli(["online", "rollback", "--drafts", str(root)]) == 0
    assert (root / "current").read_text().strip() == "v000001"
    assert cli(["online", "rollback", "v000002", "--drafts", str(root)]) == 0
    assert (root / "current").read_text().strip() == "v000002"
    assert cli(["online", "rollback", "v000009", "--drafts", str(root)]) == 2
    assert len(lines(root / "rollbacks.jsonl")) == 2


def test_bootstrap_interval_has_its_coverage():
    from specdistill.train.online.gate import mean_difference_interval as paired_bootstrap

    rng = np.random.default_rng(1)
    trials, covered = 200, 0
    for i in range(trials):
        # paired per-sequence alphas: skewed, bounded, with a known mean difference
        inc = rng.beta(2, 5, size=80)
        cand = np.clip(inc + rng.normal(0.02, 0.1, size=80), 0, 1)
        true = None
        # the true mean of the clipped difference, by a large independent sample
        if i == 0:
            big_inc = rng.beta(2, 5, size=2_000_000)
            big = np.clip(big_inc + rng.normal(0.02, 0.1, size=big_inc.size), 0, 1) - big_inc
            true_mean = big.mean()
        true = true_mean
        _, lo, hi = paired_bootstrap(cand - inc, samples=1000, confidence=0.95, seed=i)
        covered += lo <= true <= hi
    # 95% claimed: within three binomial standard deviations (±0.046 at 200 trials)
    sd = (0.95 * 0.05 / trials) ** 0.5
    assert abs(covered / trials - 0.95) <= 3 * sd, covered


def test_watch_alerts_when_served_alpha_drops(tiny_pair, traffic_pool, tmp_path):
    from specdistill.eval.stats import alpha_from_counts
    from specdistill.formats.traffic import TrafficRecord
    from specdistill.train.online.watch import Watch

    _, pool = traffic_pool
    w = Watch(window=10, trailing=3, drop=0.1)
    metrics = []
    for i in range(60):
        rate = 0.6 if i < 40 else 0.2
        r = dict(
            pool[i],
            speculative=dict(
                pool[i]["speculative"],
                num_spec_steps=2,
                num_draft_tokens=10,
                num_accepted_draft_tokens=round(rate * 10),
            ),
        )
        m = w.add(TrafficRecord.model_validate(r))
        if m:
            metrics.append(m)
    assert [m["alert"] for m in metrics] == [False, False, False, False, True, True]
    # per-token α from the window's counters (20 steps of γ=5, 20 accepted), and the rate
    assert metrics[4]["served_alpha"] == pytest.approx(alpha_from_counts(20, 100, 20))
    assert metrics[4]["acceptance_rate"] == pytest.approx(0.2)
    assert "code" in metrics[4]["per_category"]
    # the job writes them to metrics.jsonl and prints the alert
    write_shard(
        tmp_path / "traffic",
        1,
        [
            dict(
                r,
                speculative=dict(
                    r["speculative"],
                    num_spec_steps=2,
                    num_draft_tokens=10,
                    num_accepted_draft_tokens=6 if i < 40 else 1,
                ),
            )
            for i, r in enumerate(pool[:60])
        ],
    )
    printed = []
    from specdistill.train.online.job import OnlineJob

    OnlineJob(
        online_recipe(tiny_pair, tmp_path, min_gain=-1.0, refresh_records=200),
        print=lambda *a, **k: printed.append(" ".join(map(str, a))),
    ).run()
    watch = [m for m in lines(tmp_path / "out" / "metrics.jsonl") if m["kind"] == "watch"]
    assert len(watch) == 6 and watch[4]["alert"]
    assert any(line.startswith("ALERT online watch") for line in printed)


def test_follow_mode_tails_appended_lines_and_new_shards(tiny_pair, traffic_pool, tmp_path):
    import threading
    import time

    from specdistill.train.online.cursor import Cursor, read_new

    _, pool = traffic_pool
    d = tmp_path / "traffic"
    line = json.dumps(pool[0]).encode() + b"\n"
    write_shard(d, 1, [], [line, line[:20]])  # the newest shard's last line: still being written
    cursor = Cursor()
    assert [r[3] for r in read_new(d, cursor, 1 << 20)] == [None]
    assert cursor.offset == len(line)
    write_shard(d, 1, [], [line[20:]])  # its newline arrives
    assert [r[2] for r in read_new(d, cursor, 1 << 20)] == [line]
    assert {k: v for k, v in cursor.as_dict().items() if k in ("shard", "offset", "lines")} == {
        "shard": "traffic-000001.jsonl",
        "offset": 2 * len(line),
        "lines": 2,
    }

    # the job in follow mode picks up records appended later and in a new shard
    write_shard(d, 1, pool[1:20])
    recipe = online_recipe(
        tiny_pair, tmp_path, min_gain=-1.0, refresh_records=16, max_refreshes=2, poll_s=0.05
    )
    result = {}
    worker = threading.Thread(target=lambda: result.update(job(recipe).run(follow=True)))
    worker.start()
    time.sleep(1.0)
    write_shard(d, 2, pool[20:50])
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert result["refreshes"] == 2 and result["records_trained"] == 32
    assert result["cursor"]["shard"] == "traffic-000002.jsonl"


def _draft_state(out):
    from safetensors.torch import load_file

    return load_file(out / "state" / "model.safetensors")


@pytest.mark.parametrize(
    "point", ["refresh:pending", "publish:saved", "publish:renamed", "refresh:published"]
)
def test_kill_between_publish_and_commit_completes_the_publish(
    tiny_pair, traffic_pool, tmp_path, point
):
    """A kill after the publish-pending commit (before, during or after the publish, before
    the final commit): the restart completes the publish and never retrains the records."""
    import torch

    _, pool = traffic_pool
    runs = {}
    for name, crash_at in (("clean", None), ("crashed", point)):
        d = tmp_path / name
        write_shard(d / "traffic", 1, pool[:52])
        recipe = online_recipe(tiny_pair, d, min_gain=-1.0, refresh_records=16)
        steps, crashes = {"n": 0}, {"n": 0}

        def hook(p, crash_at=crash_at, steps=steps, crashes=crashes):
            if p == "refresh:step":
                steps["n"] += 1
            # the first promotion's publish (not the initial draft's)
            if p == crash_at and steps["n"] and crashes["n"] == 0:
                crashes["n"] += 1
                raise Crash(p)

        try:
            summary = job(recipe, faults=hook).run()
        except Crash:
            summary = job(recipe, faults=hook).run()
        assert crashes["n"] == (crash_at is not None)
        runs[name] = (d, summary, steps["n"])
    (a, sa, steps_a), (b, sb, steps_b) = runs["clean"], runs["crashed"]
    assert steps_b == steps_a  # no optimiser step was run again
    assert sb["records_trained"] == sa["records_trained"] == 52 - 12
    assert sb["refreshes"] == sa["refreshes"] and sb["promotions"] == sa["promotions"]
    trained = json.loads((b / "out" / "state" / "trainer_state.json").read_text())["trained_ids"]
    assert len(trained) == len(set(trained)) == 40  # none twice
    assert json.loads((b / "out" / "state" / "trainer_state.json").read_text())["pending"] is None
    da, db = _draft_state(a / "out"), _draft_state(b / "out")
    assert da.keys() == db.keys()
    for k in da:
        assert torch.equal(da[k], db[k]), k
    # the same versions, the same current, no duplicate publish
    names = lambda root: sorted(p.name for p in root.iterdir() if p.name.startswith("v"))  # noqa: E731
    assert names(b / "drafts") == names(a / "drafts")
    assert (b / "drafts" / "current").read_text() == (a / "drafts" / "current").read_text()
    assert len(lines(b / "out" / "decisions.jsonl")) == len(lines(a / "out" / "decisions.jsonl"))


def test_the_threads_are_rechecked_before_each_refresh(tiny_pair, traffic_pool, tmp_path):
    from specdistill.train.online.job import OnlineJob

    class Policy:
        rechecks = 0

        def recheck(self, say=None):
            Policy.rechecks += 1

    _, pool = traffic_pool
    write_shard(tmp_path / "traffic", 1, pool[:60])
    recipe = online_recipe(tiny_pair, tmp_path, min_gain=-1.0)
    summary = OnlineJob(recipe, print=quiet, threads=Policy()).run()
    assert summary["refreshes"] >= 2 and Policy.rechecks == summary["refreshes"]
