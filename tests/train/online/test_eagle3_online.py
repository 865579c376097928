"""The online job with an EAGLE-3 head: refresh, gate, publish in the speculators layout, the
server's loader and engine on a published head, rollback, a crash and restart."""

import json

import pytest
import torch

from tests.train.online.helpers import job, kept, lines, online_recipe, write_shard


class Crash(Exception):
    pass


@pytest.fixture(scope="module")
def trained_head(tiny_pair, traffic_pool, tmp_path_factory):
    """A small EAGLE-3 head on the tiny target (V_d 160 of its 320 tokens, from the pool's
    completion tokens), saved as `specdistill distill` saves one."""
    from specdistill.data.dataset import TokenDataset
    from specdistill.drafts.eagle3 import token_counts
    from specdistill.drafts.eagle3.head import Eagle3Head, build_vocab_map
    from specdistill.models.hub import load_model, load_tokenizer

    _, pool = traffic_pool
    target = load_model(str(tiny_pair[0]))
    tok = load_tokenizer(str(tiny_pair[0]))
    head = Eagle3Head.from_target(target, draft_vocab_size=160, aux_layers=[0, 1])
    data = TokenDataset([kept(r).tokens() for r in pool], n_records=len(pool), skipped={})
    d2t, t2d = build_vocab_map(token_counts(data, len(tok)), 160)
    head.set_vocab_map(d2t, t2d, target.get_output_embeddings().weight)
    head.ttt_steps = 2
    path = tmp_path_factory.mktemp("eagle3_head") / "head"
    head.save_pretrained(path, verifier=str(tiny_pair[0]))
    tok.save_pretrained(path)
    return path


def eagle_recipe(tiny_pair, tmp_path, draft: dict, **online):
    """online_recipe's settings with an EAGLE-3 draft section (validated by load_recipe)."""
    from specdistill.train.config import dump_recipe, load_recipe

    dump_recipe(online_recipe(tiny_pair, tmp_path, **online), tmp_path / "base.yaml")
    draft = {"type": "eagle3", "ttt_steps": 2, **draft}
    overrides = [f"draft.{k}={json.dumps(v)}" for k, v in draft.items()]
    return load_recipe(tmp_path / "base.yaml", overrides)


def greedy(engine, prompt, n):
    r = engine.add(prompt, max_new_tokens=n)
    out = []
    while engine.busy:
        out += [t for u in engine.step() if u.request == r for t in u.tokens]
    return out


def test_online_refreshes_gates_and_publishes_an_eagle3_head(
    tiny_pair, traffic_pool, trained_head, tmp_path
):
    from specdistill import drafts
    from specdistill.drafts.eagle3.head import Eagle3Head
    from specdistill.eval.engine import Engine
    from specdistill.models.hub import load_model, load_tokenizer
    from specdistill.serve.drafts import DraftWatcher
    from specdistill.train.online.versions import rollback

    _, pool = traffic_pool
    root, out = tmp_path / "drafts", tmp_path / "out"
    write_shard(tmp_path / "traffic", 1, pool[:60])
    recipe = eagle_recipe(
        tiny_pair, tmp_path, {"model": str(trained_head)}, min_gain=-1.0, max_regression=1.0
    )
    summary = job(recipe).run()
    assert summary["records_seen"] == 60 and summary["records_trained"] == 48
    decisions = lines(out / "decisions.jsonl")
    assert len(decisions) == summary["refreshes"] >= 2
    assert all(d["decision"] == "promoted" for d in decisions)  # min_gain -1: any α
    assert all(0 <= d["alpha_candidate"] <= 1 and d["n_heldout"] == 12 for d in decisions)
    current = (root / "current").read_text().strip()
    assert current == decisions[-1]["version"] != "v000001"
    manifest = json.loads((root / current / "manifest.json").read_text())
    assert manifest["draft_type"] == "eagle3" and manifest["parent"] is not None
    # published in the head's serving layout (speculators), its V_d map kept, weights trained
    assert drafts.detect(root / current) is drafts.Eagle3
    config = json.loads((root / current / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["ttt_steps"] == 2
    first = Eagle3Head.from_pretrained(trained_head)
    head = Eagle3Head.from_pretrained(root / current)
    assert torch.equal(head.d2t, first.d2t) and head.aux_layers == [0, 1]
    assert not torch.equal(head.fc.weight, first.fc.weight)
    # the server's loader (hot swap of ROOT/current) takes the version; greedy speculative
    # decoding with it gives the target's own greedy completions
    target, tok = load_model(str(tiny_pair[0])), load_tokenizer(str(tiny_pair[0]))
    found = DraftWatcher(root, target, tok, lambda *a: None, poll_s=1.0, dtype="float32").poll()
    assert found[1] == current and drafts.type_of(found[0]) is drafts.Eagle3
    engine = Engine(target, found[0], gamma=2, capacity=1, vocab_size=len(tok))
    for r in (pool[1], pool[5]):  # odd: temperature 0, the target's greedy output
        assert greedy(engine, r["prompt_token_ids"], 8) == r["completion_token_ids"]

    # a rollback, then new traffic with a crash mid-refresh: the restart resumes from the
    # rolled-back head and trains every record once
    rolled_from, rolled_to = rollback(root)
    write_shard(tmp_path / "traffic", 2, pool[60:84])
    calls = {"n": 0}

    def hook(point):
        if point == "refresh:step":
            calls["n"] += 1
            if calls["n"] == 2:
                raise Crash(point)

    with pytest.raises(Crash):
        job(recipe, faults=hook).run()
    again = job(recipe).run()
    state = json.loads((out / "state" / "trainer_state.json").read_text())
    assert len(set(state["trained_ids"])) == len(state["trained_ids"]) == 72
    assert again["refreshes"] == summary["refreshes"] + 1
    moved = [m for m in lines(out / "metrics.jsonl") if m["kind"] == "external_change"]
    assert [(m["from"], m["to"]) for m in moved] == [(rolled_from, rolled_to)]
    newest = (root / "current").read_text().strip()
    assert json.loads((root / newest / "manifest.json").read_text())["parent"] == rolled_to
    assert drafts.detect(root / newest) is drafts.Eagle3


def test_a_fresh_eagle3_head_takes_its_draft_vocabulary_from_the_anchor_set(
    tiny_pair, traffic_pool, tmp_path
):
    from specdistill.drafts.eagle3.head import Eagle3Head
    from specdistill.train.config import RecipeError

    _, pool = traffic_pool
    fresh = {"model": None, "aux_layers": [0, 1], "vocab_size": 100}
    with pytest.raises(RecipeError, match="trained EAGLE-3 head directory"):
        job(eagle_recipe(tiny_pair, tmp_path, fresh))
    write_shard(tmp_path / "anchor", 1, pool[84:96])
    anchor = str(tmp_path / "anchor")
    online = job(eagle_recipe(tiny_pair, tmp_path, fresh, anchor=[anchor], anchor_ratio=0.5))
    assert len(online.store.anchor) == 12
    head = Eagle3Head.from_pretrained(tmp_path / "drafts" / "v000001")
    completions = {t for r in pool[84:96] for t in r["completion_token_ids"]}
    assert completions <= set(head.draft_ids().tolist())
