"""The online job on a fine-tuned target (recipe `target.adapter`): it accepts the records a
server with the same base + adapter logged and refuses those of the bare base, and back."""

import json

import openai

from tests.train.online.helpers import online_recipe


def serve_some(tiny_pair, traffic, adapter, prompts):
    from specdistill.serve.options import ServeOptions
    from specdistill.serve.server import Server

    target, draft, _ = tiny_pair
    options = ServeOptions(
        target=str(target), draft=str(draft), gamma=2, max_num_seqs=2, traffic=str(traffic),
        target_adapter=None if adapter is None else str(adapter),
    )  # fmt: skip
    srv = Server(options)
    url = srv.start()
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        for p in prompts:
            client.completions.create(model=str(target), prompt=p, max_tokens=6, temperature=0)
    finally:
        srv.stop()


def run_job(tiny_pair, tmp, adapter, name, refresh=False):
    from specdistill.train.online.job import OnlineJob

    sizes = dict(refresh_records=2, holdout_size=2, min_holdout=1, min_gain=-1.0)
    recipe = online_recipe(tiny_pair, tmp, **(sizes if refresh else dict(refresh_records=1000)))
    recipe.target.adapter = None if adapter is None else str(adapter)
    recipe.online.output_dir = str(tmp / name)
    recipe.online.drafts = str(tmp / f"drafts-{name}")
    return OnlineJob(recipe, print=lambda *a, **k: None).run()


def test_adapter_records_accepted_only_by_a_job_with_that_adapter(
    tiny_pair, tiny_adapter, tmp_path
):
    traffic = tmp_path / "traffic"
    tuned = [f"def tuned_{i}(x):" for i in range(5)]
    bare = [f"class Bare{i}:" for i in range(3)]
    serve_some(tiny_pair, traffic, tiny_adapter, tuned)
    serve_some(tiny_pair, traffic, None, bare)
    records = [
        json.loads(x) for f in sorted(traffic.glob("*.jsonl")) for x in f.read_text().splitlines()
    ]
    assert len(records) == 8 and len({r["target"]["identity"] for r in records}) == 2

    # trains on them too: refreshes of the draft against the peft target
    with_adapter = run_job(tiny_pair, tmp_path, tiny_adapter, "with", refresh=True)
    assert with_adapter["records_accepted"] == 5
    assert with_adapter["refreshes"] >= 1 and with_adapter["records_trained"] == 3
    assert with_adapter["rejected_by_reason"] == {"target_identity": 3}
    rejects = (tmp_path / "with" / "rejects.jsonl").read_text().splitlines()
    rejects = [json.loads(x) for x in rejects]
    assert sorted(json.loads(r["line"])["prompt"] for r in rejects) == bare

    without = run_job(tiny_pair, tmp_path, None, "without")
    assert without["records_accepted"] == 3
    assert without["rejected_by_reason"] == {"target_identity": 5}
