"""The target cache (train/target_cache.py, `specdistill cache`, `target.cache`): the cached target
trains the draft exactly as the live one when N covers the vocabulary, a cache built for
another tokenizer, target or dataset is refused before training, and the manifest's sizes
are those of the files."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdistill import cli
from specdistill.train.config import RecipeError, load_recipe
from specdistill.train.target_cache_build import build_cache
from specdistill.train.trainer import Trainer
from tests.train.helpers import overrides

VOCAB = 320  # the tiny pair's tokenizer


def _loss_and_grads(trainer: Trainer, batch: dict) -> tuple[float, float, dict]:
    trainer.draft.zero_grad(set_to_none=True)
    loss_sum, alpha_sum = trainer.loss(batch)
    loss_sum.backward()
    loss_sum = loss_sum.detach()
    grads = {n: p.grad.clone() for n, p in trainer.draft.named_parameters() if p.grad is not None}
    trainer.draft.zero_grad(set_to_none=True)
    return float(loss_sum), float(alpha_sum), grads


@pytest.mark.parametrize("loss", ["fkl", "lk_lambda"])
def test_cache_matches_the_live_target(tiny_pair, tmp_path, loss):
    """N = V with float32 values: the loss, α and every gradient equal the live target's on
    the same micro-batches, through the whole `target.cache` wiring of Trainer.from_recipe."""
    cache = tmp_path / "cache"
    recipe = load_recipe(None, overrides(tiny_pair, tmp_path / "x", **{"loss.name": loss}))
    build_cache(recipe, cache, top_n=VOCAB, values_dtype="float32", print=lambda *a: None)
    live = Trainer.from_recipe(
        load_recipe(None, overrides(tiny_pair, tmp_path / "live", **{"loss.name": loss}))
    )
    cached = Trainer.from_recipe(
        load_recipe(
            None,
            overrides(
                tiny_pair, tmp_path / "cached", **{"loss.name": loss, "target.cache": str(cache)}
            ),
        )
    )
    assert cached.cache is not None and live.cache is None
    for step in (0, 3):
        for a, b in zip(live.micro_batches(step), cached.micro_batches(step), strict=True):
            assert "sequence" in b and "sequence" not in a
            loss_a, alpha_a, grads_a = _loss_and_grads(live, a)
            loss_b, alpha_b, grads_b = _loss_and_grads(cached, b)
            assert loss_b == pytest.approx(loss_a, rel=1e-5, abs=1e-5)
            assert alpha_b == pytest.approx(alpha_a, rel=1e-5, abs=1e-5)
            assert grads_a.keys() == grads_b.keys() and grads_a
            for name in grads_a:
                torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-5)


def test_float16_top_n_cache_is_the_coarsened_target(tiny_pair, tmp_path):
    """The stored form (float16 values, N < V): the loss is the KL between the live target and
    the draft coarsened to N + 1 bins, the target's top N and one bin for every other token
    (docs/theory.md §3, computed here by hand from the full distributions), up to the float16
    rounding of the stored values. N = V: the plain KL."""
    from specdistill.drafts.align import shifted_logits, target_mask
    from specdistill.train.target_cache import TargetCache

    live = Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, tmp_path / "live")))
    batch = live.micro_batches(0)[0]
    mask = target_mask(batch)
    with torch.no_grad():
        p = shifted_logits(live.target, batch, VOCAB).double().softmax(-1)[mask]
        q = shifted_logits(live.draft, batch, VOCAB).double().softmax(-1)[mask]
    for top_n in (VOCAB, 64, 20):
        out = tmp_path / f"cache-{top_n}"
        build_cache(
            live.recipe,
            out,
            top_n=top_n,
            target=live.target,
            tokenizer=live.tokenizer,
            train_data=live.train_data,
            eval_data=live.eval_data,
            print=lambda *a: None,
        )
        p_top, indices = p.topk(top_n, dim=-1)
        q_top = q.gather(-1, indices)
        p_bins = torch.cat([p_top, (1 - p_top.sum(-1, keepdim=True)).clamp_min(0)], -1)
        q_bins = torch.cat([q_top, (1 - q_top.sum(-1, keepdim=True)).clamp_min(0)], -1)
        if top_n == VOCAB:  # no token outside the N: no rest bin
            p_bins, q_bins = p, q
        expected = (torch.xlogy(p_bins, p_bins) - torch.xlogy(p_bins, q_bins)).sum()
        cache = TargetCache(out)
        cache.bind(live.core.kind)
        live.cache = cache
        loss_c, alpha_c, _ = _loss_and_grads(live, live.micro_batches(0)[0])
        live.cache = None
        assert loss_c == pytest.approx(float(expected), rel=2e-3), top_n
        coarse_alpha = torch.minimum(p_bins, q_bins).sum()
        assert alpha_c == pytest.approx(float(coarse_alpha), rel=2e-3), top_n
        if top_n < VOCAB:  # the rest bin carries real mass here: renormalising would differ
            renormalised = p_top / p_top.sum(-1, keepdim=True)
            truncated = (torch.xlogy(renormalised, renormalised / q_top)).sum()
            assert abs(loss_c - float(truncated)) > 0.05 * abs(float(truncated)), top_n


def test_manifest_sizes_and_shards(tiny_pair, tmp_path):
    out = tmp_path / "cache"
    args = overrides(tiny_pair, tmp_path / "unused")
    rc = cli.main(["cache", "--out", str(out), "--top-n", "20", "--shard-mb", "0.004", *args])
    assert rc == 0
    m = json.loads((out / "manifest.json").read_text())
    recipe = load_recipe(None, args)
    trainer = Trainer.from_recipe(load_recipe(None, overrides(tiny_pair, tmp_path / "t")))
    assert m["top_n"] == 20 and m["vocab_size"] == VOCAB and m["temperature"] == 1.0
    assert m["values_dtype"] == "float16" and m["indices_dtype"] == "int32"
    assert m["bytes_per_position"] == 20 * (4 + 2) + 2
    assert m["target"]["model"] == recipe.target.model
    assert m["target"]["identity"].startswith("sha256:")
    assert m["tokenizer_hash"].startswith("sha256:")
    total, positions = 0, 0
    for split, data in (("train", trainer.train_data), ("eval", trainer.eval_data)):
        s = m["splits"][split]
        expected = sum(int(data[i]["loss_mask"][1:].sum()) for i in range(len(data)))
        assert s["sequences"] == len(data) and s["positions"] == expected
        assert sum(sh["sequences"] for sh in s["shards"]) == len(data)
        first = 0
        for sh in s["shards"]:
            assert sh["first_sequence"] == first
            first += sh["sequences"]
            t = load_file(out / sh["file"])
            assert t["indices"].dtype == torch.int32 and t["indices"].shape == (sh["rows"], 20)
            assert t["logprobs"].dtype == torch.float16 and t["logprobs"].shape == (sh["rows"], 20)
            assert t["rest"].shape == (sh["rows"],)
            assert int(t["offsets"][-1]) == sh["rows"] and len(t["offsets"]) == sh["sequences"] + 1
            assert (t["logprobs"][:, :-1] >= t["logprobs"][:, 1:]).all()  # sorted
            covered = t["logprobs"].float().exp().sum(-1)
            torch.testing.assert_close(
                covered + t["rest"].float(), torch.ones_like(covered), atol=2e-2, rtol=0
            )
            assert sh["bytes"] == (out / sh["file"]).stat().st_size
            total += sh["bytes"]
            positions += sh["rows"]
    assert len(m["splits"]["train"]["shards"]) > 1  # --shard-mb small enough to shard
    assert m["total_bytes"] == total and m["positions"] == positions
    assert m["bytes_per_token"] == pytest.approx(total / positions)
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.fixture(scope="module")
def train_cache(tiny_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("c") / "cache"
    recipe = load_recipe(None, overrides(tiny_pair, out.parent / "unused"))
    build_cache(recipe, out, top_n=8, print=lambda *a: None)
    return out


def _refused(tiny_pair, run: Path, cache: Path, match: str, **extra):
    recipe = load_recipe(None, overrides(tiny_pair, run, **{"target.cache": str(cache), **extra}))
    with pytest.raises(RecipeError, match=match):
        Trainer.from_recipe(recipe)
    assert not (run / "metrics.jsonl").exists()


def test_refuses_a_cache_of_another_tokenizer(tiny_pair, other_tokenizer_draft, tmp_path):
    cache = tmp_path / "cache"
    # the other model as the target: its own tokenizer (and so its own token ids)
    recipe = load_recipe(
        None, overrides(tiny_pair, tmp_path / "u", **{"target.model": str(other_tokenizer_draft)})
    )
    build_cache(recipe, cache, top_n=8, print=lambda *a: None)
    _refused(tiny_pair, tmp_path / "run", cache, "was built with another tokenizer")


def test_refuses_a_cache_of_another_target(tiny_pair, tmp_path):
    cache = tmp_path / "cache"
    # the draft model shares the tokenizer: only the target differs
    recipe = load_recipe(
        None, overrides(tiny_pair, tmp_path / "u", **{"target.model": str(tiny_pair[1])})
    )
    build_cache(recipe, cache, top_n=8, print=lambda *a: None)
    _refused(tiny_pair, tmp_path / "run", cache, "was built for another target")
    # the same weights at another dtype are another target's distributions too
    _refused(
        tiny_pair,
        tmp_path / "run2",
        cache,
        "was built for another target",
        **{"target.model": str(tiny_pair[1])} | {"target.dtype": "bfloat16"},
    )


def test_refuses_a_cache_of_another_dataset(tiny_pair, train_cache, tmp_path):
    _refused(
        tiny_pair,
        tmp_path / "run",
        train_cache,
        "built on another train dataset",
        **{"data.max_length": 24},
    )
    _refused(
        tiny_pair,
        tmp_path / "run2",
        train_cache,
        "built on another train dataset",
        **{"train.seed": 1},
    )


def test_refuses_a_missing_cache_a_top_n_one_for_eagle3_and_what_it_cannot_know(
    tiny_pair, train_cache, tmp_path
):
    _refused(tiny_pair, tmp_path / "run", tmp_path / "nothing", "no manifest.json")
    with pytest.raises(RecipeError, match="top-N cache, which holds neither .* hidden states"):
        load_recipe(
            None,
            overrides(
                tiny_pair,
                tmp_path / "e",
                **{"draft.type": "eagle3", "draft.model": "null", "target.cache": train_cache},
            ),
        )
    for extra in ({"loss.temperature": 0.8}, {"loss.params.top_p": 0.9}):
        with pytest.raises(RecipeError, match="at temperature 1 and the mass it drops"):
            load_recipe(
                None, overrides(tiny_pair, tmp_path / "t", **extra, **{"target.cache": "x"})
            )
    with pytest.raises(RecipeError, match="set loss.chunk_size=null"):
        load_recipe(
            None,
            overrides(
                tiny_pair, tmp_path / "c", **{"loss.chunk_size": 8, "target.cache": str(tmp_path)}
            ),
        )


def test_build_refuses_a_non_empty_out(tiny_pair, train_cache, tmp_path):
    from specdistill.train.target_cache import CacheError

    recipe = load_recipe(None, overrides(tiny_pair, tmp_path / "u"))
    with pytest.raises(CacheError, match="not empty; pass --overwrite"):
        build_cache(recipe, train_cache, top_n=8, print=lambda *a: None)
