"""The online job at its edges: poisoned records, chosen clients, used and shared directories,
a missing or rewritten traffic directory, a broken version to roll back to."""

import json
import math
import re

import pytest

from tests.train.online.helpers import online_recipe, write_shard


def quiet(*args, **kwargs):
    pass


def job(recipe, print=quiet, faults=None):
    from specdistill.train.online.job import OnlineJob

    return OnlineJob(recipe, print=print, **({"faults": faults} if faults else {}))


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def poisoned(pool):
    """(raw line, expected reason) for records a hostile client or a broken converter writes."""
    r = pool[0]

    def edit(i, **changes):
        rec = json.loads(json.dumps(pool[i]))
        for path, value in changes.items():
            *parents, key = path.split("__")
            node = rec
            for p in parents:
                node = node[p]
            node[key] = value
        rec["id"] = f"poison-{i}"
        return (json.dumps(rec, allow_nan=True) + "\n").encode()

    ids = r["completion_token_ids"]
    deep = b"[" * 100_000 + b"]" * 100_000 + b"\n"
    return [
        (edit(1, sampling__temperature=math.nan), "malformed_json"),  # NaN token
        (edit(2, sampling__temperature=math.inf), "malformed_json"),  # Infinity token
        (edit(3, sampling__temperature=-1.0), "sampling"),
        (edit(4, sampling__temperature=True), "sampling"),
        (edit(5, sampling__temperature="0.7"), "sampling"),
        (edit(6, sampling__temperature=1e-30), "sampling"),
        (edit(7, sampling__top_p=0.0), "sampling"),
        (edit(8, sampling__top_p=1.5), "sampling"),
        (edit(9, completion_token_ids=[-1] + ids[1:]), "token_out_of_range"),
        (edit(10, completion_token_ids=[10**6] + ids[1:]), "token_out_of_range"),
        (edit(11, completion_token_ids=[1.5] + ids[1:]), "schema"),
        (edit(12, completion_token_ids=[True] + ids[1:]), "schema"),
        (edit(13, top_logprobs=[[[1, math.nan]]] * len(ids)), "malformed_json"),
        (edit(14, top_logprobs=[7] * len(ids)), "schema"),  # an entry of another shape
        (edit(15, top_logprobs=[[[1, -0.1], [1, -0.2]]] * len(ids)), "top_logprobs"),
        (edit(16, top_logprobs=[[[10**6, -0.1]]] * len(ids)), "top_logprobs"),
        (edit(17, top_logprobs=[[[1, 3.0]]] * len(ids)), "top_logprobs"),
        (edit(18, speculative__num_draft_tokens=-5), "speculative"),
        (edit(19, time="yesterday"), "schema"),
        (edit(21, category="c" * 10_000), "schema"),
        (edit(22, sampling__max_tokens=-1), "sampling"),
        (edit(23, speculative__acceptance_histogram=[-1]), "speculative"),
        (edit(24, endpoint="evil"), "schema"),
        (edit(25, finish_reason="evil"), "schema"),
        (edit(26, time=-1), "schema"),
        (edit(27, latency_s=-1), "schema"),
        (edit(20, sampling__temperature=1e999), "malformed_json"),  # overflows to inf
        (re.sub(r'"temperature": [^,]+', '"temperature": 1e400', json.dumps(r)).encode() + b"\n",
         "malformed_json"),
        (deep, "malformed_json"),
        (b"\xff\xfe{}\n", "malformed_json"),
        (b"[1, 2, 3]\n", "schema"),
    ]  # fmt: skip


def test_poisoned_records_are_rejected_by_reason_and_never_stop_the_job(
    tiny_pair, traffic_pool, tmp_path
):
    _, pool = traffic_pool
    bad = poisoned(pool)
    write_shard(tmp_path / "traffic", 1, [], [raw for raw, _ in bad])
    write_shard(tmp_path / "traffic", 2, pool[30:60])
    recipe = online_recipe(tiny_pair, tmp_path, min_gain=-1.0)
    summary = job(recipe).run()
    expected = {}
    for _, reason in bad:
        expected[reason] = expected.get(reason, 0) + 1
    assert summary["rejected_by_reason"] == expected
    assert summary["records_accepted"] == 30 and summary["refreshes"] >= 1
    rejects = lines(tmp_path / "out" / "rejects.jsonl")
    assert len(rejects) == len(bad) and all(r["detail"] or r["reason"] for r in rejects)
    # a restart on the same traffic neither fails nor takes anything twice
    again = job(recipe).run()
    assert again["records_accepted"] == 30 and again["records_rejected"] == len(bad)


def test_random_mutations_of_a_record_never_escape_screen(tiny_pair, traffic_pool):
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    from specdistill.train.online.kept import KeptRecord
    from specdistill.train.online.screen import screen

    identity, pool = traffic_pool
    base = pool[0]
    vocab = 320
    leaves = st.one_of(
        st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.floats(allow_nan=True),
        st.text(max_size=5), st.just([]), st.just({}), st.lists(st.integers(-5, 400), max_size=4),
        st.lists(st.lists(st.tuples(st.integers(-2, 400), st.floats()), max_size=3), max_size=9),
    )  # fmt: skip

    def paths(node, prefix=()):
        yield prefix
        if isinstance(node, dict):
            for k, v in node.items():
                yield from paths(v, prefix + (k,))
        elif isinstance(node, list) and node:
            yield from paths(node[0], prefix + (0,))

    all_paths = list(paths(base))[1:]

    def has(node, key) -> bool:  # an earlier mutation may have changed the node's type
        if isinstance(node, dict):
            return isinstance(key, str) and key in node
        return isinstance(node, list) and isinstance(key, int) and key < len(node)

    def put(rec, path, value) -> None:
        node = rec
        for key in path[:-1]:
            if not has(node, key):
                return
            node = node[key]
        if has(node, path[-1]):
            node[path[-1]] = value

    @hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
    @hypothesis.given(st.lists(st.tuples(st.sampled_from(all_paths), leaves), max_size=3))
    def check(mutations):
        rec = json.loads(json.dumps(base))
        for path, value in mutations:
            put(rec, path, value)
        raw = (json.dumps(rec, allow_nan=True) + "\n").encode()
        screened = screen(raw, identity, max_tokens=64, vocab_size=vocab)
        if screened.reason is None:  # what is accepted is in range
            item = KeptRecord.of(screened.record, True)
            t = item.temperature
            assert math.isfinite(t) and (t == 0 or 1e-4 <= t <= 100)
            tokens = item.tokens()
            assert 0 <= tokens.ids.min() and tokens.ids.max() < vocab

    check()


def with_client(records, client, start):
    return [dict(r, id=f"{client}-{start + i}", client=client) for i, r in enumerate(records)]


def test_online_clients_trains_only_on_the_chosen_clients(tiny_pair, traffic_pool, tmp_path):
    from specdistill.train.config import RecipeError

    _, pool = traffic_pool
    a, b = "key-0123456789ab", "key-ba9876543210"
    write_shard(
        tmp_path / "traffic",
        1,
        with_client(pool[:30], a, 0) + with_client(pool[30:50], b, 30) + pool[50:60],
    )
    recipe = online_recipe(tiny_pair, tmp_path, min_gain=-1.0, clients=[a])
    summary = job(recipe).run()
    assert summary["records_accepted"] == 30
    assert summary["skipped_by_reason"] == {"client": 30}
    assert not (tmp_path / "out" / "rejects.jsonl").exists()  # a skip is not a reject
    state = json.loads((tmp_path / "out" / "state" / "trainer_state.json").read_text())
    kept = state["trained_ids"] + [r["id"] for r in state["store"]["holdout"]]
    assert kept and all(i.startswith(a) for i in kept)
    with pytest.raises(RecipeError, match="online.clients: 'alice'"):
        online_recipe(tiny_pair, tmp_path, clients=["alice"])


def test_a_used_output_dir_is_refused_and_its_files_kept(tiny_pair, traffic_pool, tmp_path):
    from specdistill.publish import OutputDirError

    _, pool = traffic_pool
    write_shard(tmp_path / "traffic", 1, pool[:30])
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"mine": 1}\n')
    (out / "rejects.jsonl").write_text('{"mine": 2}\n')
    recipe = online_recipe(tiny_pair, tmp_path, min_gain=-1.0)
    with pytest.raises(OutputDirError, match="metrics.jsonl.*online.overwrite=true"):
        job(recipe)
    assert (out / "metrics.jsonl").read_text() == '{"mine": 1}\n'
    assert (out / "rejects.jsonl").read_text() == '{"mine": 2}\n'
    recipe.online.overwrite = True
    assert job(recipe).run()["records_accepted"] == 30
    # this job's own state: resumed without overwrite
    recipe.online.overwrite = False
    assert job(recipe).run()["records_accepted"] == 30
    # the same OUT for another drafts root: refused
    recipe.online.drafts = str(tmp_path / "other-drafts")
    with pytest.raises(OutputDirError, match="drafts root"):
        job(recipe)
    assert (out / "state" / "trainer_state.json").is_file()


def test_a_second_job_or_a_rollback_fails_at_once_while_a_job_runs(
    tiny_pair, traffic_pool, tmp_path, capsys
):
    from specdistill.cli import main as cli
    from specdistill.publish import OutputDirError

    _, pool = traffic_pool
    write_shard(tmp_path / "traffic", 1, pool[:30])
    first = job(online_recipe(tiny_pair, tmp_path, min_gain=-1.0))
    try:
        with pytest.raises(OutputDirError, match="in use by"):  # the same OUT
            job(online_recipe(tiny_pair, tmp_path, min_gain=-1.0))
        other_out = online_recipe(tiny_pair, tmp_path, min_gain=-1.0)
        other_out.online.output_dir = str(tmp_path / "out2")
        with pytest.raises(OutputDirError, match="drafts.*in use by"):  # the same ROOT
            job(other_out)
        capsys.readouterr()
        assert cli(["online", "rollback", "--drafts", str(tmp_path / "drafts")]) == 2
        assert "in use by" in capsys.readouterr().err
    finally:
        first.close()
    assert first.run()["records_accepted"] == 30  # run takes the locks again


def test_a_missing_traffic_directory_is_an_error_or_a_warning_when_following(tiny_pair, tmp_path):
    recipe = online_recipe(tiny_pair, tmp_path)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "traffic"))):
        job(recipe).run()
    said = []
    j = job(recipe, print=lambda *a, **k: said.append(" ".join(map(str, a))))
    j.stop_event.set()  # one poll, then stop
    summary = j.run(follow=True)
    assert summary["records_seen"] == 0
    assert sum("does not exist yet" in s and str(tmp_path / "traffic") in s for s in said) == 1


def test_a_shard_rewritten_under_the_cursor_is_read_again_not_skipped(
    tiny_pair, traffic_pool, tmp_path
):
    _, pool = traffic_pool
    traffic = tmp_path / "traffic"
    write_shard(traffic, 1, pool[:20])
    recipe = online_recipe(tiny_pair, tmp_path, refresh_records=1000)
    assert job(recipe).run()["records_accepted"] == 20
    shard = traffic / "traffic-000001.jsonl"
    shard.unlink()  # rewritten: 10 records taken already, 20 new ones
    write_shard(traffic, 1, pool[10:40])
    said = []
    summary = job(recipe, print=lambda *a, **k: said.append(" ".join(map(str, a)))).run()
    assert summary["records_accepted"] == 40 and summary["duplicates"] == 10
    assert summary["shards_rewritten"] == 1 and summary["records_rejected"] == 0
    assert any("WARNING" in s and str(shard) in s for s in said)
    # truncated below the cursor: detected too
    shard.write_bytes(shard.read_bytes()[:100])
    write_shard(traffic, 2, pool[40:45])
    summary = job(recipe).run()
    assert summary["shards_rewritten"] == 2 and summary["records_accepted"] == 45
    # the cursor's shard deleted: reading goes on with the next one
    write_shard(traffic, 3, pool[45:50])
    (traffic / "traffic-000002.jsonl").unlink()
    summary = job(recipe).run()
    assert summary["shards_gone"] == 1 and summary["records_accepted"] == 50


def publish_two(tiny_pair, root):
    from specdistill.drafts.loader import load_draft
    from specdistill.formats.published import Manifest
    from specdistill.models.hub import load_tokenizer
    from specdistill.train.online.versions import publish_version

    tok = load_tokenizer(str(tiny_pair[0]))
    model = load_draft(str(tiny_pair[1]))
    for _ in range(2):
        publish_version(
            root, lambda d: (model.save_pretrained(d), tok.save_pretrained(d)), Manifest()
        )
    assert (root / "current").read_text().strip() == "v000002"


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_rollback_to_a_broken_version_fails_before_moving_current(
    tiny_pair, tmp_path, capsys, damage
):
    from specdistill.cli import main as cli

    root = tmp_path / "drafts"
    publish_two(tiny_pair, root)
    weights = root / "v000001" / "model.safetensors"
    if damage == "deleted":
        weights.unlink()
    else:
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    capsys.readouterr()
    assert cli(["online", "rollback", "--drafts", str(root)]) == 2
    err = capsys.readouterr().err
    assert "v000001" in err and "does not load" in err and "current stays v000002" in err
    assert (root / "current").read_text().strip() == "v000002"
    assert not (root / "rollbacks.jsonl").exists()


def test_a_broken_current_version_never_stops_a_refresh(tiny_pair, traffic_pool, tmp_path):
    _, pool = traffic_pool
    root = tmp_path / "drafts"
    publish_two(tiny_pair, root)
    write_shard(tmp_path / "traffic", 1, pool[:40])
    (root / "v000002" / "model.safetensors").unlink()  # broken after it was published
    said = []
    recipe = online_recipe(tiny_pair, tmp_path, min_gain=-1.0)
    summary = job(recipe, print=lambda *a, **k: said.append(" ".join(map(str, a)))).run()
    assert summary["refreshes"] >= 1 and summary["promotions"] == 0
    decisions = lines(tmp_path / "out" / "decisions.jsonl")
    assert all("v000002 does not load" in d["why"] for d in decisions)
    assert sum(s.startswith("ALERT online: version v000002") for s in said) == 1


def test_decisions_break_the_gate_down_by_request_temperature(tiny_pair, traffic_pool, tmp_path):
    """Greedy requests score argmax agreement, which a temperature-1 loss does not train: the
    decision shows α per served temperature, so a rejection caused by the greedy share (the
    embedded tiny pair: α 0.975 -> 0.006 at T=0 while 0.79 -> 0.91 at T=1) is visible."""
    _, pool = traffic_pool
    write_shard(tmp_path / "traffic", 1, pool[:40])  # temperatures 1 and 0, alternating
    said = []
    job(
        online_recipe(tiny_pair, tmp_path),
        print=lambda *a, **k: said.append(" ".join(map(str, a))),
    ).run()
    decisions = lines(tmp_path / "out" / "decisions.jsonl")
    assert decisions
    for d in decisions:
        temps = d["by_temperature"]
        assert set(temps) == {"0", "1"} and sum(v["n"] for v in temps.values()) == d["n_heldout"]
        weighted = sum(v["n"] * v["alpha_candidate"] for v in temps.values()) / d["n_heldout"]
        assert weighted == pytest.approx(d["alpha_candidate"])
    assert any("alpha by temperature (incumbent -> candidate): T=0 " in s for s in said)


def test_a_drafts_root_inside_a_new_output_dir_is_not_a_used_dir(tiny_pair, traffic_pool, tmp_path):
    """The defaults put ROOT inside OUT (runs/online/drafts in runs/online): a ROOT made
    before the job's first start does not make OUT a used directory."""
    _, pool = traffic_pool
    write_shard(tmp_path / "traffic", 1, pool[:20])
    recipe = online_recipe(tiny_pair, tmp_path, refresh_records=1000)
    recipe.online.drafts = str(tmp_path / "out" / "drafts")
    (tmp_path / "out" / "drafts").mkdir(parents=True)
    assert job(recipe).run()["records_accepted"] == 20
    assert (tmp_path / "out" / "drafts" / "current").is_file()


def test_one_version_name_rule_and_the_manifest_round_trip(tmp_path):
    from specdistill.formats.published import Manifest, read_manifest, version_name, version_number
    from specdistill.train.online.versions import next_version

    assert version_name(1) == "v000001" and version_number("v000012") == 12
    assert [version_number(n) for n in ("v12", "v0000012", "x000001", "current")] == [None] * 4
    (tmp_path / "v000007").mkdir()
    (tmp_path / "v12").mkdir()
    assert next_version(tmp_path) == "v000008"
    manifest = Manifest(version="v000007", parent=None, reason="promoted", ci=[0.1, 0.2])
    manifest.write(tmp_path / "v000007")
    assert read_manifest(tmp_path / "v000007") == manifest
    assert read_manifest(tmp_path / "v12") == Manifest()  # no manifest.json
