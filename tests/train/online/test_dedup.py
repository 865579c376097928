"""Which served records the online job keeps: exact repeats never, a prompt up to its cap."""

import json

from tests.train.online.helpers import online_recipe, write_shard


def item(i: int, prompt: list[int], completion: list[int]):
    from specdistill.train.online.kept import KeptRecord

    return KeptRecord(f"r{i}", 0.0, prompt, completion, temperature=0.0)


def store(max_per_prompt: int, **sizes):
    from specdistill.train.online.store import Store

    s = dict(recent_size=8, reservoir_size=4, holdout_size=2, dedup_size=1000) | sizes
    return Store(**s, max_per_prompt=max_per_prompt)


def add(st, it):
    return st.add(it)


def test_a_prompt_with_other_completions_is_kept_up_to_the_cap_an_exact_repeat_never():
    st = store(max_per_prompt=3)
    prompt = [5, 6, 7]
    assert add(st, item(0, prompt, [1, 2])) is None
    assert add(st, item(1, prompt, [1, 2])) == "duplicate"  # the same prompt and completion
    assert add(st, item(2, prompt, [3])) is None  # the same prompt, another completion
    assert add(st, item(3, prompt, [4])) is None
    assert add(st, item(4, prompt, [5])) == "prompt_cap"  # held 3 times already
    assert add(st, item(5, [9], [1, 2])) is None  # another prompt, the same completion
    held = [*st.holdout, *st.recent, *st.reservoir]
    assert sorted(it.id for it in held) == ["r0", "r2", "r3", "r5"]


def test_the_cap_counts_what_is_held_and_frees_with_eviction():
    """Records that leave the store (pushed out of recent, not kept by the reservoir) free
    their prompt's slots; a restored state counts the same."""
    from specdistill.train.online.store import Store

    st = store(max_per_prompt=2, recent_size=2, reservoir_size=0, holdout_size=0)
    prompt = [1, 2]
    assert add(st, item(0, prompt, [3])) is None
    assert add(st, item(1, prompt, [4])) is None
    assert add(st, item(2, prompt, [5])) == "prompt_cap"
    for i in range(3, 5):  # other prompts push both out of `recent`
        assert add(st, item(i, [i], [i])) is None
    assert add(st, item(5, prompt, [5])) is None
    restored = Store(2, 0, 0, 1000, 2)
    restored.load(json.loads(json.dumps(st.state())))
    assert restored.held == st.held
    assert add(restored, item(6, prompt, [4])) == "duplicate"  # remembered beyond the store
    assert add(restored, item(7, prompt, [6])) is None
    assert add(restored, item(8, prompt, [7])) == "prompt_cap"


def test_the_job_trains_repeats_of_a_prompt_up_to_online_max_per_prompt(
    tiny_pair, traffic_pool, tmp_path
):
    from specdistill.train.online.job import OnlineJob

    identity, pool = traffic_pool
    hot = pool[1]
    repeats = [  # one popular prompt, sampled 6 times with other completions, and 2 exact repeats
        dict(hot, id=f"hot-{k}", completion_token_ids=[k + 10, k + 11, k + 12]) for k in range(6)
    ] + [dict(hot, id="hot-again"), dict(pool[2], id="again")]
    # the repeats before the last 20 records, so that they are trained, not held out
    write_shard(tmp_path / "traffic", 1, pool[:20] + repeats + pool[20:40])
    recipe = online_recipe(tiny_pair, tmp_path, min_gain=-1.0, max_per_prompt=3)
    job = OnlineJob(recipe, print=lambda *a, **k: None)
    summary = job.run()
    assert summary["duplicates"] == 2  # exact repeats, never trained
    assert summary["over_prompt_cap"] == 4  # hot held once + 6 others: 2 kept, 4 over the cap
    assert summary["records_accepted"] == 40 + 2
    hot_ids = {hot["id"], "hot-again", *(f"hot-{k}" for k in range(6))}
    assert hot_ids & set(job.trained_ids) == {hot["id"], "hot-0", "hot-1"}
    assert "again" not in job.trained_ids
    # the counts by reason are in the job's metrics, with every refresh
    metrics = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    counts = [m["counts"] for m in metrics if m["kind"] == "refresh"][-1]
    assert counts["duplicate"] == 2 and counts["prompt_cap"] == 4
