"""The embedded model builder, on the micro "tiny" / "tiny-draft" pair (seconds to build)."""

import dataclasses
import json
import multiprocessing
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdistill.data.stdlib import stdlib_files
from specdistill.models import embedded, embedded_train


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    """A cache with "tiny" and "tiny-draft" built once, shared by the read-only tests."""
    root = tmp_path_factory.mktemp("embedded_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDISTILL_CACHE", str(root))
        paths = {
            name: embedded.resolve_model(f"embedded:{name}") for name in ("tiny", "tiny-draft")
        }
        yield root, paths


@pytest.fixture
def tmp_cache_root(tmp_path, monkeypatch):
    """SPECDISTILL_CACHE pointed at an empty temporary directory (returned)."""
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path))
    return tmp_path


def test_cache_root_follows_env(tmp_cache_root, monkeypatch):
    assert embedded.cache_root() == tmp_cache_root
    monkeypatch.delenv("SPECDISTILL_CACHE")
    assert embedded.cache_root() == Path.home() / ".cache" / "specdistill"


def test_resolve_builds_hf_dirs_that_load_with_from_pretrained(tiny_cache):
    root, paths = tiny_cache
    for name in ("tiny", "tiny-draft"):
        assert paths[name] == str(root / "embedded" / name)
        spec = embedded.EMBEDDED[name]
        model = AutoModelForCausalLM.from_pretrained(paths[name])
        tokenizer = AutoTokenizer.from_pretrained(paths[name])
        assert model.config.model_type == "llama"
        assert model.config.hidden_size == spec.hidden_size
        assert model.config.num_hidden_layers == spec.num_layers
        assert model.config.vocab_size == len(tokenizer) == spec.corpus.vocab_size
        eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        assert tokenizer.eos_token_id == tokenizer.pad_token_id == eos
        assert model.config.eos_token_id == model.config.pad_token_id == eos
        assert model.generation_config.eos_token_id == eos
        ids = tokenizer("def f(x):\n    return x\n", return_tensors="pt").input_ids
        logits = model(input_ids=ids).logits
        assert logits.shape == (1, ids.shape[1], len(tokenizer))
        assert torch.isfinite(logits).all()


def test_build_record(tiny_cache):
    _, paths = tiny_cache
    record = json.loads((Path(paths["tiny"]) / embedded.BUILD_RECORD).read_text())
    assert record["build_version"] == embedded.BUILD_VERSION
    assert record["spec"] == embedded.record_spec(embedded.EMBEDDED["tiny"])
    assert record["train_steps"] == embedded.EMBEDDED["tiny"].steps
    assert 0 < record["heldout_loss"] < 10
    assert record["seed"] == 0


def test_second_resolve_does_not_rebuild(tiny_cache, monkeypatch):
    root, paths = tiny_cache
    monkeypatch.setenv("SPECDISTILL_CACHE", str(root))

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt a current model")

    monkeypatch.setattr(embedded, "_train_model", fail)
    before = os.stat(Path(paths["tiny"]) / "model.safetensors").st_mtime_ns
    assert embedded.resolve_model("embedded:tiny") == paths["tiny"]
    assert embedded.build("tiny") == Path(paths["tiny"])
    assert os.stat(Path(paths["tiny"]) / "model.safetensors").st_mtime_ns == before


def test_outdated_build_is_rebuilt(tmp_cache_root, monkeypatch):
    path = embedded.build("tiny-draft")
    monkeypatch.setattr(embedded, "BUILD_VERSION", embedded.BUILD_VERSION + 1)
    built = []
    original = embedded._train_model
    monkeypatch.setattr(embedded, "_train_model", lambda *a: built.append(a[0]) or original(*a))
    assert embedded.resolve_model("embedded:tiny-draft") == str(path)
    assert built == ["tiny-draft"]
    record = json.loads((path / embedded.BUILD_RECORD).read_text())
    assert record["build_version"] == embedded.BUILD_VERSION
    assert not list((tmp_cache_root / "embedded").glob(".*-*"))  # no temp or replaced dirs left


def test_target_and_draft_share_the_tokenizer(tiny_cache):
    _, paths = tiny_cache
    target = AutoTokenizer.from_pretrained(paths["tiny"])
    draft = AutoTokenizer.from_pretrained(paths["tiny-draft"])
    assert target.get_vocab() == draft.get_vocab()
    for file in ("tokenizer.json", "tokenizer_config.json"):
        a = (Path(paths["tiny"]) / file).read_bytes()
        assert a == (Path(paths["tiny-draft"]) / file).read_bytes()


def test_chat_template_renders_chatml(tiny_cache):
    _, paths = tiny_cache
    tokenizer = AutoTokenizer.from_pretrained(paths["tiny"])
    messages = [{"role": "user", "content": "Write a loop."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWrite a loop.<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids


def test_byte_level_round_trip_on_stdlib_source(tiny_cache):
    _, paths = tiny_cache
    tokenizer = AutoTokenizer.from_pretrained(paths["tiny"])
    source = stdlib_files("heldout")[0].read_text(encoding="utf-8")[:3000]
    source += "\n\t# tabs, trailing spaces   \n\n\n# ünïcödé → 字 🐍\r\n"
    ids = tokenizer(source).input_ids
    assert tokenizer.eos_token_id not in ids  # no special tokens added by default
    assert tokenizer.decode(ids) == source


def test_builds_are_deterministic(tmp_cache_root, tmp_path_factory, monkeypatch):
    """Two forced builds, and a build in a fresh cache (tokenizer retrained): same bytes."""
    first = load_file(embedded.build("tiny", force=True) / "model.safetensors")
    second = load_file(embedded.build("tiny", force=True) / "model.safetensors")
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path_factory.mktemp("other_cache")))
    fresh_dir = embedded.build("tiny")
    fresh = load_file(fresh_dir / "model.safetensors")
    assert first.keys() == second.keys() == fresh.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key
        assert torch.equal(first[key], fresh[key]), key
    tokenizer_json = (tmp_cache_root / "embedded" / "tiny" / "tokenizer.json").read_bytes()
    assert (fresh_dir / "tokenizer.json").read_bytes() == tokenizer_json
    norm = first["model.norm.weight"]
    assert not torch.equal(norm, torch.ones_like(norm))  # it trained away from the init


def test_interrupted_build_leaves_no_final_dir(tmp_cache_root, monkeypatch):
    calls = []

    def crash(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return 1.0

    monkeypatch.setattr(embedded_train, "train_step", crash)
    with pytest.raises(KeyboardInterrupt):
        embedded.resolve_model("embedded:tiny-draft")
    assert not (tmp_cache_root / "embedded" / "tiny-draft").exists()
    assert not list((tmp_cache_root / "embedded").glob(".tmp-*"))
    monkeypatch.undo()
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_cache_root))
    path = embedded.resolve_model("embedded:tiny-draft")
    AutoModelForCausalLM.from_pretrained(path)


def test_leftovers_of_a_killed_build_are_removed(tmp_cache_root):
    stale = tmp_cache_root / "embedded" / ".tmp-tiny-draft-killed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"partial")
    embedded.build("tiny-draft")
    assert not stale.exists()


def _resolve_in_child(name, barrier, results):
    """Runs in a spawned process: resolve `name` once both processes are ready."""
    built = []
    original = embedded._train_model
    embedded._train_model = lambda *args: built.append(args[0]) or original(*args)
    barrier.wait()
    path = embedded.resolve_model(name)
    model = AutoModelForCausalLM.from_pretrained(path)
    AutoTokenizer.from_pretrained(path)
    results.put((built, path, float(model.model.norm.weight.sum())))


def test_concurrent_processes_build_once(tmp_cache_root):
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    children = [
        context.Process(target=_resolve_in_child, args=("embedded:tiny-draft", barrier, results))
        for _ in range(2)
    ]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=120) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert sorted(len(built) for built, _, _ in outcomes) == [0, 1]
    assert {path for _, path, _ in outcomes} == {str(tmp_cache_root / "embedded" / "tiny-draft")}
    assert outcomes[0][2] == outcomes[1][2]


def test_unknown_embedded_name(tmp_cache_root):
    with pytest.raises(ValueError, match="embedded:code-draft"):
        embedded.resolve_model("embedded:nope")
    with pytest.raises(ValueError, match="unknown embedded model 'embedded:nope'"):
        embedded.build("nope")


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-0.5B", "/models/target", "./embedded:code"])
def test_other_names_pass_through(tmp_cache_root, name):
    assert embedded.resolve_model(name) == name
    assert not (tmp_cache_root / "embedded").exists()


def test_the_prose_family_is_keyed_by_its_text_and_code_records_stay_as_they_were():
    code = embedded.record_spec(embedded.EMBEDDED["code"])
    prose = embedded.record_spec(embedded.EMBEDDED["prose"])
    assert "text" not in code["corpus"]  # builds recorded before the field still match
    assert prose["corpus"]["text"] == "prose"
    assert embedded.EMBEDDED["prose"].corpus == embedded.EMBEDDED["prose-draft"].corpus


def test_growth_repeats_each_layer_and_divides_its_residual_outputs():
    from transformers import LlamaConfig, LlamaForCausalLM

    def config(layers):
        return LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )

    torch.manual_seed(0)
    shallow = LlamaForCausalLM(config(2))
    rng_state = torch.get_rng_state()
    deep = embedded_train.grown(shallow, config(6))
    assert torch.equal(torch.get_rng_state(), rng_state)  # the caller's RNG is untouched
    assert len(deep.model.layers) == 6
    for i, layer in enumerate(deep.model.layers):
        source = shallow.model.layers[i // 3]
        assert torch.equal(layer.self_attn.q_proj.weight, source.self_attn.q_proj.weight)
        assert torch.equal(layer.mlp.up_proj.weight, source.mlp.up_proj.weight)
        assert torch.allclose(layer.self_attn.o_proj.weight * 3, source.self_attn.o_proj.weight)
        assert torch.allclose(layer.mlp.down_proj.weight * 3, source.mlp.down_proj.weight)
    assert torch.equal(deep.model.embed_tokens.weight, shallow.model.embed_tokens.weight)
    assert deep.lm_head.weight.data_ptr() == deep.model.embed_tokens.weight.data_ptr()
    # Repeating a layer k times at 1/k strength is a first-order copy of the shallow model.
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        p_shallow = shallow(input_ids=ids).logits.softmax(-1)
        p_deep = deep(input_ids=ids).logits.softmax(-1)
    assert (p_shallow - p_deep).abs().sum(-1).max() < 0.2


def test_a_grown_build_trains_both_stages_and_records_them(tmp_cache_root, monkeypatch):
    grown = dataclasses.replace(
        embedded.EMBEDDED["tiny"], num_layers=4, grow_from_layers=2, grow_at_step=12
    )
    monkeypatch.setitem(embedded.EMBEDDED, "tiny-grown", grown)
    stages = []
    original = embedded_train.train_step
    monkeypatch.setattr(
        embedded_train,
        "train_step",
        lambda model, *a: stages.append(len(model.model.layers)) or original(model, *a),
    )
    path = embedded.resolve_model("embedded:tiny-grown")
    assert stages == [2] * 12 + [4] * (grown.steps - 12)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.num_hidden_layers == 4
    record = json.loads((Path(path) / embedded.BUILD_RECORD).read_text())
    assert record["spec"]["grow_from_layers"] == 2 and record["spec"]["grow_at_step"] == 12
    assert record["n_params"] == sum(p.numel() for p in model.parameters())
    # Specs without growth keep the records they had before the fields existed.
    assert "grow_from_layers" not in embedded.record_spec(embedded.EMBEDDED["code"])


def test_growth_needs_a_layer_count_that_divides_and_a_step_inside_the_run():
    base = embedded.EMBEDDED["tiny"]
    with pytest.raises(ValueError, match="not a multiple"):
        dataclasses.replace(base, num_layers=3, grow_from_layers=2, grow_at_step=5)
    with pytest.raises(ValueError, match="grow_at_step"):
        dataclasses.replace(base, num_layers=4, grow_from_layers=2, grow_at_step=base.steps)


def test_a_build_follows_the_free_cores_between_steps(tmp_cache_root, monkeypatch):
    """A spec without a thread count builds on the cores free at its start and re-checks
    them after every step (specdistill/threads.py); a spec's own count is kept."""
    from specdistill import threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # else a forced count
    chosen, rechecks = [], []

    class Policy(threads.ThreadPolicy):
        def start(self):
            chosen.append(self.forced)
            return super().start()

        def recheck(self, say=None):
            rechecks.append(say)
            return None

    monkeypatch.setattr(embedded, "ThreadPolicy", Policy)
    loose = dataclasses.replace(embedded.EMBEDDED["tiny"], threads=None)
    monkeypatch.setitem(embedded.EMBEDDED, "tiny-loose", loose)
    embedded.resolve_model("embedded:tiny-loose")
    assert chosen == [None] and len(rechecks) == loose.steps and all(rechecks)
    before = torch.get_num_threads()
    embedded.resolve_model("embedded:tiny")
    assert chosen == [None, embedded.EMBEDDED["tiny"].threads]
    assert torch.get_num_threads() == before  # restored after the build
