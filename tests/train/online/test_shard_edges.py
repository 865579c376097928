"""The online job's cursor at its edges: a shard deleted under the cursor never sends it back
to earlier shards (exactly once without the dedup window), and a shard's name on a
directory or on a symlink leading out of the traffic directory is skipped, not read."""

import json
import os

from tests.train.online.helpers import online_recipe, write_shard


def job(recipe, said=None):
    from specdistill.train.online.job import OnlineJob

    def record(*args, **kwargs):
        if said is not None:
            said.append(" ".join(map(str, args)))

    return OnlineJob(recipe, print=record)


def trained_ids(out):
    return json.loads((out / "state" / "trainer_state.json").read_text())["trained_ids"]


def test_a_deleted_cursor_shard_moves_on_never_back(tiny_pair, traffic_pool, tmp_path):
    _, pool = traffic_pool
    traffic = tmp_path / "traffic"
    write_shard(traffic, 1, pool[:20])
    write_shard(traffic, 2, pool[20:30])
    recipe = online_recipe(tiny_pair, tmp_path, refresh_records=1000, dedup_size=10)
    assert job(recipe).run()["records_accepted"] == 30
    (traffic / "traffic-000002.jsonl").unlink()  # the cursor's shard, the newest
    summary = job(recipe).run()
    assert summary["shards_gone"] == 1 and summary["records_accepted"] == 30
    assert summary["duplicates"] == 0
    write_shard(traffic, 3, pool[30:35])  # read on after the deleted shard's name
    summary = job(recipe).run()
    assert summary["shards_gone"] == 1 and summary["records_accepted"] == 35
    ids = trained_ids(tmp_path / "out")
    assert len(ids) == len(set(ids)) and summary["records_trained"] == len(ids)


def test_a_shard_that_is_no_regular_file_inside_the_folder_is_skipped(
    tiny_pair, traffic_pool, tmp_path
):
    _, pool = traffic_pool
    traffic = tmp_path / "traffic"
    write_shard(traffic, 1, pool[:10])
    (traffic / "traffic-000002.jsonl").mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"password=hunter2\n" + (json.dumps(pool[40]) + "\n").encode())
    os.symlink(secret, traffic / "traffic-000003.jsonl")
    write_shard(traffic, 4, pool[10:20])
    recipe = online_recipe(tiny_pair, tmp_path, refresh_records=1000)
    for _ in range(2):  # a restart finds the same entries and goes on
        said = []
        summary = job(recipe, said).run()
        assert summary["records_accepted"] == 20 and summary["records_rejected"] == 0
        for name in ("traffic-000002.jsonl", "traffic-000003.jsonl"):
            assert sum("not a regular file" in s and name in s for s in said) == 1
    rejects = tmp_path / "out" / "rejects.jsonl"
    assert not rejects.exists() or b"hunter2" not in rejects.read_bytes()
    assert summary["shards_skipped"] == 4  # two entries, once in each run
