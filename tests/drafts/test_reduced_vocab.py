"""A standalone draft made of the target's layers (drafts/draft_init.py) and one with a reduced
output vocabulary (drafts/standalone/reduced_vocab.py, `ReducedStandalone` in drafts/standalone/):
q = 0 outside V_d, save / load through the project's loader with its map checked, the lean forward,
the recipe's build, training depths and chains, and export (hf with its K rows; for vLLM
and SGLang over the whole vocabulary, drafts/standalone/full_vocab.py)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill import drafts
from specdistill.drafts import loader
from specdistill.drafts.draft_init import (
    DraftInitError,
    choose_layers,
    draft_from_target,
    init_from_target,
    layers_spec,
)
from specdistill.drafts.standalone.reduced_vocab import ReducedVocabError, with_reduced_head
from specdistill.drafts.vocab_map import VocabMapError, build_vocab_map
from specdistill.models import hub, lean
from specdistill.models.kv_cache import KVStream
from specdistill.models.weights import IncompleteDraftError
from specdistill.train.config import RecipeError, load_recipe
from tests.models.helpers import SIZES, VOCAB, run_stream

K = 40


def target_model(tied: bool = False, layers: int = 3) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**SIZES | {"num_hidden_layers": layers, "tie_word_embeddings": tied})
    return LlamaForCausalLM(config).eval()


def vocab_map(k: int = K, seed: int = 0):
    counts = torch.randint(0, 1000, (VOCAB,), generator=torch.Generator().manual_seed(seed))
    return build_vocab_map(counts, k)


def reduced(tied: bool = False):
    """(full model, the same with a K-row head, its t2d)."""
    full = target_model(tied)
    d2t, t2d = vocab_map()
    return full, with_reduced_head(full, d2t, t2d).eval(), t2d


IDS = torch.tensor([[5, 6, 7, 9, 3, 1, 40, 2], [8, 1, 2, 3, 4, 5, 6, 7]])


# ----------------------------------------------------------------------------- init from target


@pytest.mark.parametrize("tied", [False, True])
def test_a_draft_of_all_the_targets_layers_is_the_target(tied):
    target = target_model(tied)
    draft = draft_from_target(target, [0, 1, 2])
    with torch.no_grad():
        torch.testing.assert_close(draft(input_ids=IDS).logits, target(input_ids=IDS).logits)
    assert draft.config.tie_word_embeddings == tied
    # no tensor shared with the target: training the draft leaves the target as it is
    ours = {p.data_ptr() for p in draft.parameters()}
    assert not ours & {p.data_ptr() for p in target.parameters()}


def test_chosen_layers_are_copied_exactly_and_renumbered():
    target = target_model(layers=4)
    draft = draft_from_target(target, [1, 3])
    assert draft.config.num_hidden_layers == 2
    theirs, ours = target.state_dict(), draft.state_dict()
    for name, tensor in ours.items():
        source = name
        for mine, theirs_index in ((0, 1), (1, 3)):
            prefix = f"model.layers.{mine}."
            if name.startswith(prefix):
                source = f"model.layers.{theirs_index}." + name[len(prefix) :]
        assert torch.equal(tensor, theirs[source]), name


def test_layer_choices_and_their_errors():
    assert choose_layers(3, 30).indices == (0, 1, 2)
    assert choose_layers(1, 30).indices == (0,)
    assert choose_layers(30, 30).indices == tuple(range(30))
    assert choose_layers([0, 15, 29], 30).indices == (0, 15, 29)
    assert layers_spec("target-layers:3") == 3
    assert layers_spec("target-layers:0,15,29") == [0, 15, 29]
    assert layers_spec("embedded:tiny-draft") is None and layers_spec(None) is None
    with pytest.raises(DraftInitError, match="layer 30 is out of range: the target has 30"):
        choose_layers([0, 30], 30)
    with pytest.raises(DraftInitError, match="distinct and increasing"):
        choose_layers([3, 1], 30)
    with pytest.raises(DraftInitError, match="31 layers asked of a target with 30"):
        choose_layers(31, 30)
    with pytest.raises(DraftInitError, match="target-layers:N"):
        layers_spec("target-layers:a,b")


def test_init_from_target_writes_a_loadable_directory(tiny_pair, tmp_path):
    target = hub.load_target(str(tiny_pair[0]))
    tokenizer = hub.load_tokenizer(str(tiny_pair[0]))
    out = init_from_target(target, tokenizer, 1, tmp_path / "draft")
    draft = loader.load_draft(str(out))
    assert draft.config.num_hidden_layers == 1
    hub.check_tokenizers(tokenizer, hub.load_tokenizer(str(out)), "target", "draft")
    assert drafts.detect(out) is drafts.Standalone


# ----------------------------------------------------------------------------- reduced head


@pytest.mark.parametrize("tied", [False, True])
def test_q_is_zero_outside_the_draft_vocabulary(tied):
    full, draft, t2d = reduced(tied)
    with torch.no_grad():
        logits = draft(input_ids=IDS).logits
        small = draft(input_ids=IDS, full_vocab=False).logits
        expected = full(input_ids=IDS).logits
    assert logits.shape == (*IDS.shape, VOCAB) and small.shape == (*IDS.shape, K)
    assert bool(torch.isneginf(logits[..., ~t2d]).all())
    assert bool(logits.float().softmax(-1)[..., ~t2d].eq(0).all())
    torch.testing.assert_close(logits[..., t2d], expected[..., t2d])
    torch.testing.assert_close(small, expected[..., t2d])
    assert draft.lm_head.weight.shape == (K, 64)
    assert drafts.type_of(draft) is drafts.ReducedStandalone
    assert drafts.ReducedStandalone.vocab_size_of(draft) == VOCAB
    assert drafts.compared_vocab_size(full, draft=draft) == VOCAB


def test_save_load_round_trip_checks_the_map(tmp_path):
    _, draft, _ = reduced(tied=True)
    draft.save_pretrained(tmp_path / "d")
    loaded = loader.load_draft(str(tmp_path / "d"))
    assert drafts.detect(tmp_path / "d") is drafts.ReducedStandalone
    assert torch.equal(loaded.lm_head.d2t, draft.lm_head.d2t)
    assert torch.equal(loaded.lm_head.t2d, draft.lm_head.t2d)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=IDS).logits, draft(input_ids=IDS).logits)
    weights = tmp_path / "d" / "model.safetensors"
    state = load_file(weights)
    bad = dict(state)
    bad["lm_head.d2t"] = torch.zeros_like(state["lm_head.d2t"])  # every draft id -> id i
    save_file(bad, weights)
    with pytest.raises(VocabMapError, match="t2d"):
        loader.load_draft(str(tmp_path / "d"))
    save_file({k: v for k, v in state.items() if k != "lm_head.t2d"}, weights)
    with pytest.raises(IncompleteDraftError, match="lm_head.t2d"):
        loader.load_draft(str(tmp_path / "d"))


def test_reduced_head_errors():
    full = target_model()
    d2t, t2d = vocab_map()
    with pytest.raises(VocabMapError, match="t2d marks"):
        with_reduced_head(full, d2t, torch.ones_like(t2d))
    qwen = type("Config", (), {"model_type": "qwen2"})()
    with pytest.raises(ReducedVocabError, match="model_type is 'qwen2'"):
        with_reduced_head(type("M", (), {"config": qwen})(), d2t, t2d)
    with pytest.raises(VocabMapError, match="draft vocab size must be in"):
        build_vocab_map(torch.ones(VOCAB), VOCAB + 1)


@torch.no_grad()
def test_lean_forward_with_the_k_row_head_equals_the_plain_forward():
    _, draft, t2d = reduced()
    assert lean.why_not(draft) is None
    fast = KVStream(draft, VOCAB, torch.device("cpu"))
    plain = KVStream(draft, VOCAB, torch.device("cpu"), lean=False)
    assert fast.lean is not None
    for a, b in zip(run_stream(fast), run_stream(plain), strict=True):
        assert bool(torch.isneginf(a[..., ~t2d]).all() and torch.isneginf(b[..., ~t2d]).all())
        torch.testing.assert_close(a[..., t2d], b[..., t2d], rtol=1e-5, atol=1e-5)
    assert draft.lm_head.weight.shape == (K, 64)  # the only head the lean forward can run


# ----------------------------------------------------------------------------- recipe and build


def recipe_for(tiny_pair, tmp_path, **extra):
    from tests.train.helpers import overrides

    return load_recipe(None, overrides(tiny_pair, tmp_path / "run", **extra))


def test_build_reduces_the_draft_and_trains_over_v_d(tiny_pair, tmp_path):
    from specdistill.train.config import recipe_datasets

    recipe = recipe_for(tiny_pair, tmp_path, **{"draft.vocab_size": 50})
    target = hub.load_target(str(tiny_pair[0]))
    tokenizer = hub.load_tokenizer(str(tiny_pair[0]))
    train_data = recipe_datasets(recipe, tokenizer)[0]
    draft, kind = drafts.build(recipe.draft, target, tokenizer, train_data, print=print)
    assert isinstance(kind, drafts.ReducedStandalone) and kind.name == "standalone"
    assert kind.vocab_size == len(tokenizer) and kind.d2t is draft.lm_head.d2t
    # the type reads the map where the head holds it now (`.to(device)` replaces buffers)
    draft.lm_head.register_buffer("d2t", draft.lm_head.d2t.clone())
    assert kind.d2t is draft.lm_head.d2t
    batch = {
        "input_ids": torch.as_tensor(train_data[0]["input_ids"][:16])[None],
        "attention_mask": torch.ones(1, 16, dtype=torch.long),
        "loss_mask": torch.ones(1, 16, dtype=torch.bool),
    }
    (d,), (t,), _ = kind.depths(draft, target, batch)
    assert d.shape == (1, 15, 50) and t.shape == (1, 15, len(tokenizer))
    chains = kind.chains(draft, target, batch, [3, 6], gamma=3, temperature=1.0)
    assert chains.draft.shape[-1] == 50 and int(chains.tokens.max()) < 50
    assert chains.target.shape[-1] == len(tokenizer)
    # the chains' draft ids are the sampled target tokens, in V_d
    kind.save(draft, tmp_path / "saved", tokenizer, "target")
    again = recipe_for(tiny_pair, tmp_path, **{"draft.model": str(tmp_path / "saved")})
    loaded, kind2 = drafts.build(again.draft, target, tokenizer, None, print=print)
    assert isinstance(kind2, drafts.ReducedStandalone)
    assert torch.equal(loaded.lm_head.d2t, draft.lm_head.d2t)
    other = recipe_for(
        tiny_pair, tmp_path, **{"draft.model": str(tmp_path / "saved"), "draft.vocab_size": 60}
    )
    with pytest.raises(ReducedVocabError, match="reduced output vocabulary of 50 tokens"):
        drafts.build(other.draft, target, tokenizer, None, print=print)


def test_a_parallel_draft_with_a_reduced_vocabulary(tiny_pair, tmp_path):
    """draft.type=parallel with draft.vocab_size: the mask token is one more input row, the
    head keeps K rows, every depth trains over V_d, and the saved draft reloads as the same
    type; a saved reduced standalone draft becomes one by gaining a mask token."""
    from specdistill.train.config import recipe_datasets

    extra = {"draft.vocab_size": 50, "draft.type": "parallel", "draft.parallel_depths": 3}
    recipe = recipe_for(tiny_pair, tmp_path, **extra)
    target = hub.load_target(str(tiny_pair[0]))
    tokenizer = hub.load_tokenizer(str(tiny_pair[0]))
    train_data = recipe_datasets(recipe, tokenizer)[0]
    draft, kind = drafts.build(recipe.draft, target, tokenizer, train_data, print=print)
    v = len(tokenizer)
    assert isinstance(kind, drafts.ReducedParallel) and kind.name == "parallel"
    assert kind.vocab_size == v and kind.mask_id == v and kind.d2t is draft.lm_head.d2t
    assert draft.get_input_embeddings().weight.shape[0] == v + 1
    assert draft.lm_head.weight.shape[0] == 50 and draft.lm_head.vocab_size == v + 1
    assert not bool(draft.lm_head.t2d[v])  # the mask token is never proposed
    batch = {
        "input_ids": torch.as_tensor(train_data[0]["input_ids"][:16])[None],
        "attention_mask": torch.ones(1, 16, dtype=torch.long),
        "loss_mask": torch.ones(1, 16, dtype=torch.bool),
    }
    d, t, m = kind.depths(draft, target, batch)
    assert [x.shape for x in d] == [(1, 15, 50)] * 3 and t[0].shape == (1, 15, v)
    assert drafts.type_of(draft) is drafts.ReducedParallel
    assert drafts.compared_vocab_size(target, draft=draft) == v
    kind.save(draft, tmp_path / "saved", tokenizer, "target")
    assert drafts.detect(tmp_path / "saved") is drafts.ReducedParallel
    again = recipe_for(tiny_pair, tmp_path, **{**extra, "draft.model": str(tmp_path / "saved")})
    loaded, kind2 = drafts.build(again.draft, target, tokenizer, None, print=print)
    assert isinstance(kind2, drafts.ReducedParallel) and kind2.mask_id == v
    assert torch.equal(loaded.lm_head.d2t, draft.lm_head.d2t)
    assert torch.equal(loaded.get_input_embeddings().weight, draft.get_input_embeddings().weight)
    from specdistill.train.export import ExportError, export

    with pytest.raises(ExportError, match="export it as hf"):
        export(tmp_path / "saved", "vllm", tmp_path / "vllm")
    exported = export(tmp_path / "saved", "hf", tmp_path / "hf")
    assert json.loads((exported / "config.json").read_text())["pard_token"] == v

    standalone = recipe_for(tiny_pair, tmp_path, **{"draft.vocab_size": 50})
    reduced, _ = drafts.build(standalone.draft, target, tokenizer, train_data, print=print)
    drafts.ReducedStandalone(v, reduced.lm_head).save(reduced, tmp_path / "sa", tokenizer, "t")
    grown = recipe_for(tiny_pair, tmp_path, **{**extra, "draft.model": str(tmp_path / "sa")})
    draft, kind = drafts.build(grown.draft, target, tokenizer, None, print=print)
    assert isinstance(kind, drafts.ReducedParallel) and kind.mask_id == v
    assert torch.equal(draft.lm_head.weight, reduced.lm_head.weight)  # the head is kept
    rows = draft.get_input_embeddings().weight
    assert torch.equal(rows[:v], reduced.get_input_embeddings().weight)
    assert torch.allclose(rows[v], rows[:v].mean(0))


def test_recipe_refuses_what_a_reduced_vocabulary_cannot_do(tiny_pair, tmp_path):
    with pytest.raises(RecipeError, match="loss.chunk_size is not supported with draft.vocab"):
        recipe_for(tiny_pair, tmp_path, **{"draft.vocab_size": 50, "loss.chunk_size": 8})


def test_export_writes_hf_with_its_k_rows(tmp_path):
    from specdistill.train.export import Options, export_with_plan, load_export, serve_hint
    from tests.helpers import make_tokenizer

    _, draft, _ = reduced()
    draft.save_pretrained(tmp_path / "d")
    make_tokenizer(VOCAB).save_pretrained(tmp_path / "d")
    options = Options(source=tmp_path / "d")
    out, kind, plan = export_with_plan(tmp_path / "d", "hf", tmp_path / "hf", options)
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == K
    # the serve hint names the server that loads it, not vLLM
    assert serve_hint("hf", kind, out, plan).startswith("specdistill serve --target")
    back = load_export(out, "hf")
    assert torch.equal(back.lm_head.d2t, draft.lm_head.d2t)


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_the_engines_get_the_whole_vocabulary_with_v_d_unchanged(tmp_path, fmt):
    """vLLM and SGLang load a plain causal LM over the whole vocabulary: its V_d logits are
    the draft's, every other logit is 0, so its argmax is the draft's wherever the draft's
    best logit is positive."""
    from specdistill.train.export import Options, export_with_plan, load_export
    from tests.helpers import make_tokenizer

    _, draft, _ = reduced()
    draft.save_pretrained(tmp_path / "d")
    make_tokenizer(VOCAB).save_pretrained(tmp_path / "d")
    out = export_with_plan(tmp_path / "d", fmt, tmp_path / fmt, Options(source=tmp_path / "d"))[0]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == VOCAB
    assert "draft_vocab_size" not in config
    full = load_export(out, fmt)
    assert drafts.detect(out) is drafts.Standalone
    ids = torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = draft(input_ids=ids).logits, full(input_ids=ids).logits
    inside = draft.lm_head.draft_ids()
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[inside] = False
    torch.testing.assert_close(theirs[..., inside], ours[..., inside], rtol=0, atol=1e-5)
    assert torch.equal(theirs[..., outside], torch.zeros_like(theirs[..., outside]))
    positive = ours.max(-1).values > 0
    assert positive.float().mean() > 0.5  # the check below is not empty
    assert torch.equal(theirs.argmax(-1)[positive], ours.argmax(-1)[positive])


def test_the_export_warns_where_the_best_logit_is_not_positive(tmp_path, capsys):
    from specdistill.train.export import export
    from tests.helpers import make_tokenizer

    _, draft, _ = reduced()
    with torch.no_grad():
        draft.lm_head.weight.zero_()  # every logit 0: the engine's argmax is anyone's
    draft.save_pretrained(tmp_path / "d")
    make_tokenizer(VOCAB).save_pretrained(tmp_path / "d")
    export(tmp_path / "d", "vllm", tmp_path / "vllm")
    err = capsys.readouterr().err
    assert "lowest on the calibration text: 0)" in err
    assert "warning: the draft's best logit is not positive everywhere" in err
