"""train/export/: every format re-loads to the exact same logits; bad maps never get written."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specdistill.drafts.eagle3.head import Eagle3Head, VocabMapError
from specdistill.train.export import FORMATS, ExportError, export, load_export
from specdistill.train.export_cli import main
from tests.eagle3_heads import DRAFT_VOCAB, HIDDEN, VOCAB, tiny_config, trained_head
from tests.helpers import make_tokenizer

ROOT = Path(__file__).resolve().parents[2]
LAYER_WEIGHTS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
)
TOP_WEIGHTS = ("d2t", "t2d", "embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight")


@pytest.fixture(scope="module")
def llama_target(tmp_path_factory):
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_config(LlamaConfig)).eval()
    path = tmp_path_factory.mktemp("llama_target")
    target.save_pretrained(path)
    return target, path


@pytest.fixture(scope="module")
def head_dir(llama_target, tmp_path_factory):
    target, target_dir = llama_target
    head = trained_head(target)
    path = tmp_path_factory.mktemp("head")
    head.save_pretrained(path, verifier=str(target_dir), verifier_arch=["LlamaForCausalLM"])
    (path / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    return head, path


def inputs(seed: int = 3, batch: int = 2, length: int = 10):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(batch, length, 3 * HIDDEN, generator=g)
    ids = torch.randint(0, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, -3:] = False  # right padding in the second row
    return features, ids, mask


def assert_same_logits(a: Eagle3Head, b: Eagle3Head, steps: int = 3):
    features, ids, mask = inputs()
    with torch.no_grad():
        ours, theirs = a.unroll(features, ids, mask, steps), b.unroll(features, ids, mask, steps)
        assert len(ours) == len(theirs) == steps
        for x, y in zip(ours, theirs, strict=True):
            assert torch.equal(x, y)
        hidden_a, hidden_b = a.fc(features), b.fc(features)
        assert torch.equal(hidden_a, hidden_b)
        out_a, out_b = a(ids, hidden_a, attention_mask=mask), b(ids, hidden_b, attention_mask=mask)
        assert torch.equal(out_a.logits, out_b.logits)  # full vocab: exercises d2t too
        assert torch.equal(out_a.hidden_states, out_b.hidden_states)


def assert_same_state(a: Eagle3Head, b: Eagle3Head):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


# ----------------------------------------------------------------------------- EAGLE-3 heads


@pytest.mark.parametrize("fmt", FORMATS)
def test_head_round_trip_gives_identical_logits(head_dir, tmp_path, fmt):
    head, src = head_dir
    out = export(src, fmt, tmp_path / "out")
    loaded = load_export(out, fmt)
    assert isinstance(loaded, Eagle3Head)
    assert loaded.aux_layers == head.aux_layers
    assert loaded.norm_before_residual == head.norm_before_residual
    assert_same_state(head, loaded)
    assert_same_logits(head, loaded)
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 128}\n'
    assert not list(tmp_path.glob(".out*")), "temporary directories left behind"


def test_vllm_config_writes_every_field(head_dir, llama_target, tmp_path):
    head, src = head_dir
    out = export(src, "vllm", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["target_hidden_size"] == HIDDEN
    assert config["eagle_aux_hidden_state_layer_ids"] == head.aux_layers == [1, 2, 3]
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert config[key] is False, key  # explicit: the package and vLLM defaults differ
    assert config["embed_requires_grad"] is False
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama"
    assert layer["num_hidden_layers"] == 1
    assert (layer["vocab_size"], layer["hidden_size"], layer["head_dim"]) == (VOCAB, HIDDEN, 8)
    assert (layer["num_attention_heads"], layer["num_key_value_heads"]) == (4, 2)
    assert layer["rope_parameters"]["rope_theta"] == 10000.0
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert spec["verifier"] == {
        "name_or_path": str(llama_target[1]),
        "architectures": ["LlamaForCausalLM"],
    }
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(TOP_WEIGHTS) | {f"layers.0.{n}" for n in LAYER_WEIGHTS}
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert weights["lm_head.weight"].shape == (DRAFT_VOCAB, HIDDEN)
    assert weights["fc.weight"].shape == (HIDDEN, 3 * HIDDEN)
    assert weights["layers.0.self_attn.q_proj.weight"].shape == (HIDDEN, 2 * HIDDEN)


def test_hf_format_is_the_speculators_layout(head_dir, tmp_path):
    _, src = head_dir
    vllm, hf = export(src, "vllm", tmp_path / "vllm"), export(src, "hf", tmp_path / "hf")
    for name in ("config.json", "model.safetensors"):
        assert (vllm / name).read_bytes() == (hf / name).read_bytes()


def test_sglang_config_and_weight_names(head_dir, tmp_path):
    head, src = head_dir
    out = export(src, "sglang", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama"
    expected = {
        "hidden_size": HIDDEN,
        "intermediate_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": head.config.rms_norm_eps,
        "max_position_embeddings": 128,
        "vocab_size": VOCAB,
        "hidden_act": "silu",
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": HIDDEN,
        "rope_theta": 10000.0,
    }
    assert {k: config[k] for k in expected} == expected
    assert config["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    # SGLang names the layer whose output is captured: ours (the layer entered) minus one.
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(TOP_WEIGHTS) | {f"midlayer.{n}" for n in LAYER_WEIGHTS}
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    ours = head.state_dict()
    assert torch.equal(weights["midlayer.hidden_norm.weight"], ours["layers.0.hidden_norm.weight"])
    assert torch.equal(weights["fc.weight"], ours["fc.weight"])


def test_sglang_export_reads_back_as_a_draft(head_dir, tmp_path):
    """An SGLang export is itself a valid --draft: converting it to vllm loses nothing."""
    _, src = head_dir
    sgl = export(src, "sglang", tmp_path / "sgl")
    direct = export(src, "vllm", tmp_path / "direct")
    via = export(
        sgl,
        "vllm",
        tmp_path / "via",
        verifier=json.loads((direct / "config.json").read_text())["speculators_config"]["verifier"][
            "name_or_path"
        ],
    )
    assert (direct / "config.json").read_text() == (via / "config.json").read_text()
    a, b = load_file(str(direct / "model.safetensors")), load_file(str(via / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_norm_before_residual_head_sglang_refused_vllm_exact(llama_target, tmp_path):
    target, target_dir = llama_target
    head = trained_head(target, seed=1, norm_before_residual=True)
    src = tmp_path / "head"
    head.save_pretrained(src, verifier=str(target_dir))
    with pytest.raises(ExportError, match="norm_before_residual"):
        export(src, "sglang", tmp_path / "sgl")
    assert not (tmp_path / "sgl").exists()
    out = export(src, "vllm", tmp_path / "vllm")
    assert json.loads((out / "config.json").read_text())["norm_before_residual"] is True
    loaded = load_export(out, "vllm")
    assert loaded.norm_before_residual
    assert_same_logits(head, loaded)


def test_sglang_refusals(llama_target, tmp_path):
    head = trained_head(llama_target[0], aux_layers=[1, 3])
    with pytest.raises(ExportError, match="exactly 3 feature layers"):
        export(head, "sglang", tmp_path / "sgl")
    head = trained_head(llama_target[0], aux_layers=[0, 2, 3])  # layer 0: no SGLang name
    with pytest.raises(ExportError, match="feature layer 0"):
        export(head, "sglang", tmp_path / "sgl")
    assert not (tmp_path / "sgl").exists()
    wrong = tmp_path / "wrong_target"
    LlamaConfig(vocab_size=VOCAB + 1, hidden_size=HIDDEN).save_pretrained(wrong)
    with pytest.raises(ExportError, match="vocab_size 65"):
        export(trained_head(llama_target[0]), "sglang", tmp_path / "sgl", verifier=str(wrong))
    assert not (tmp_path / "sgl").exists()


def test_bfloat16_head_keeps_its_dtype(llama_target, tmp_path):
    head = trained_head(llama_target[0]).to(torch.bfloat16)
    src = tmp_path / "head"
    head.save_pretrained(src)
    for fmt in FORMATS:
        out = export(src, fmt, tmp_path / fmt)
        weights = load_file(str(out / "model.safetensors"))
        assert weights["fc.weight"].dtype == torch.bfloat16
        assert weights["d2t"].dtype == torch.int64
        loaded = load_export(out, fmt)
        assert loaded.fc.weight.dtype == torch.bfloat16
        assert_same_state(head, loaded)


def test_qwen2_target_head_round_trips(tmp_path):
    torch.manual_seed(5)
    target = Qwen2ForCausalLM(tiny_config(Qwen2Config)).eval()
    head = trained_head(target, seed=5)
    src = tmp_path / "head"
    head.save_pretrained(src)
    for fmt in FORMATS:
        loaded = load_export(export(src, fmt, tmp_path / fmt), fmt)
        assert_same_state(head, loaded)
        assert_same_logits(head, loaded)


# ----------------------------------------------------------------------------- verifier


def test_verifier_from_the_training_recipe(head_dir, llama_target, tmp_path):
    head, _ = head_dir
    run = tmp_path / "run"
    head.save_pretrained(run / "final")  # no verifier in the head's own config
    recipe = {"target": {"model": str(llama_target[1])}, "draft": {"model": "eagle3"}}
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    out = export(run / "final", "vllm", tmp_path / "out")
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(llama_target[1]), "architectures": ["LlamaForCausalLM"]}


def test_verifier_flag_wins_and_is_checked(head_dir, tmp_path):
    _, src = head_dir
    out = export(src, "hf", tmp_path / "out", verifier="some-org/some-target")
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": "some-org/some-target", "architectures": []}

    wrong = tmp_path / "wrong_target"
    LlamaConfig(vocab_size=VOCAB, hidden_size=48, num_attention_heads=4).save_pretrained(wrong)
    with pytest.raises(ExportError, match="hidden_size 48"):
        export(src, "vllm", tmp_path / "bad", verifier=str(wrong))
    assert not (tmp_path / "bad").exists()


def test_embedded_verifier_is_written_as_its_built_directory(
    head_dir, tmp_path, monkeypatch, capsys
):
    """The trainer records `embedded:code`, which neither vLLM nor speculators can load."""
    head, _ = head_dir
    src = tmp_path / "head"
    head.save_pretrained(src, verifier="embedded:code")
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    out = export(src, "vllm", tmp_path / "unbuilt")
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == "embedded:code"
    assert "not built" in capsys.readouterr().err

    built = tmp_path / "cache" / "embedded" / "code"
    config = tiny_config(LlamaConfig)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(built)
    out = export(src, "vllm", tmp_path / "built")
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(built), "architectures": ["LlamaForCausalLM"]}


# ----------------------------------------------------------------------------- the vocab map


def corrupt(d2t: torch.Tensor, t2d: torch.Tensor, case: str):
    d2t, t2d = d2t.clone(), t2d.clone()
    if case == "duplicate":  # draft id 1 -> the same target id as draft id 0
        d2t[1] = d2t[0] - 1
    elif case == "out_of_range":
        d2t[-1] = VOCAB - (DRAFT_VOCAB - 1)
    elif case == "t2d_disagrees":  # same count, one id swapped for one outside V_d
        outside = int(torch.nonzero(~t2d)[0])
        t2d[outside] = True
        t2d[int(d2t[0])] = False  # draft id 0 maps to target id d2t[0] (0 + d2t[0])
    elif case == "wrong_dtype":
        d2t = d2t.to(torch.int32)
    elif case == "bool_as_int":
        t2d = t2d.to(torch.uint8)
    elif case == "missing":
        t2d = None
    return d2t, t2d


CASES = ("duplicate", "out_of_range", "t2d_disagrees", "wrong_dtype", "bool_as_int", "missing")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_corrupted_map_in_the_draft_dir_is_refused(head_dir, tmp_path, case, fmt):
    _, src = head_dir
    bad = tmp_path / "bad_head"
    bad.mkdir()
    (bad / "config.json").write_bytes((src / "config.json").read_bytes())
    state = load_file(str(src / "model.safetensors"))
    d2t, t2d = corrupt(state["d2t"], state["t2d"], case)
    state["d2t"] = d2t
    if t2d is None:
        del state["t2d"]
    else:
        state["t2d"] = t2d
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(VocabMapError):
        export(bad, fmt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert main(["--draft", str(bad), "--format", fmt, "--out", str(tmp_path / "o2")]) == 2
    assert not (tmp_path / "o2").exists()


@pytest.mark.parametrize("case", [c for c in CASES if c != "missing"])
def test_corrupted_map_in_memory_is_refused(llama_target, tmp_path, case):
    head = trained_head(llama_target[0])
    d2t, t2d = corrupt(head.d2t, head.t2d, case)
    head.d2t, head.t2d = d2t, t2d  # bypassing set_vocab_map, as a buggy trainer could
    for fmt in FORMATS:
        with pytest.raises(VocabMapError):
            export(head, fmt, tmp_path / fmt)
        assert not (tmp_path / fmt).exists()


# ----------------------------------------------------------------------------- --out handling


def test_non_empty_out_needs_overwrite(head_dir, tmp_path):
    _, src = head_dir
    out = tmp_path / "out"
    out.mkdir()
    export(src, "vllm", out)  # an empty directory is fine
    (out / "note.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not empty"):
        export(src, "sglang", out)
    assert (out / "note.txt").read_text() == "keep me"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Eagle3Speculator"]
    export(src, "sglang", out, overwrite=True)
    assert not (out / "note.txt").exists()
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLMEagle3"
    ]
    with pytest.raises(ExportError, match="must not be"):
        export(src, "vllm", src, overwrite=True)
    with pytest.raises(ExportError, match="unknown format"):
        export(src, "onnx", tmp_path / "x")


# ----------------------------------------------------------------------------- standalone


@pytest.fixture(scope="module")
def standalone_dir(tmp_path_factory):
    tokenizer = make_tokenizer()
    torch.manual_seed(7)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("standalone")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer, path


@pytest.mark.parametrize("fmt", FORMATS)
def test_standalone_round_trip(standalone_dir, tmp_path, fmt):
    model, tokenizer, src = standalone_dir
    out = export(src, fmt, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (out / "model.safetensors").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    loaded = load_export(out, fmt).eval()
    ids = torch.tensor([tokenizer.encode("def add(a, b):\n    return a + b\n")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert AutoTokenizer.from_pretrained(out).encode("for i in range(3)") == tokenizer.encode(
        "for i in range(3)"
    )


def test_not_a_draft_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="no config.json"):
        export(tmp_path / "empty", "vllm", tmp_path / "out")
    with pytest.raises(ExportError, match="does not exist"):
        export(tmp_path / "missing", "vllm", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- CLI


def test_cli(head_dir, standalone_dir, tmp_path, capsys):
    _, src = head_dir
    out = tmp_path / "sgl"
    assert main(["--draft", str(src), "--format", "sglang", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "--speculative-algorithm EAGLE3" in printed and str(out) in printed
    assert main(["--draft", str(src), "--format", "vllm", "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["--draft", str(src), "--format", "vllm", "--out", str(out), "--overwrite"]) == 0
    assert '"method": "eagle3"' in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Eagle3Speculator"]

    out = tmp_path / "standalone"
    assert main(["--draft", str(standalone_dir[2]), "--format", "sglang", "--out", str(out)]) == 0
    assert "--speculative-algorithm STANDALONE" in capsys.readouterr().out


def test_cli_as_a_script(standalone_dir, tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "specdistill.train.export", "--draft", str(standalone_dir[2])]
        + ["--format", "vllm", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert '"num_speculative_tokens": 5' in run.stdout
    assert (out / "model.safetensors").is_file()


def test_specdistill_export_verb(standalone_dir, tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "specdistill", "export", "--draft", str(standalone_dir[2])]
        + ["--format", "sglang", "--out", str(out), "--speculative-tokens", "4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "--speculative-algorithm STANDALONE" in run.stdout
    assert "--speculative-num-steps 4" in run.stdout
    assert "--speculative-num-draft-tokens 5" in run.stdout


def test_export_subpackage_is_packaged():
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "specdistill.train.export" in packages["packages"]


# ----------------------------------------------------------------------------- speculative tokens


class _Tokenizer:
    def save_pretrained(self, out):
        (Path(out) / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')


def proposal_tokens(out: Path) -> int:
    config = json.loads((out / "config.json").read_text())
    (method,) = config["speculators_config"]["proposal_methods"]
    return method["speculative_tokens"]


@pytest.fixture
def depth5_dir(llama_target, tmp_path):
    """A head saved the way the trainer saves it after training with draft.ttt_steps=5."""
    from specdistill import drafts

    target, target_dir = llama_target
    head = trained_head(target, seed=2)
    kind = drafts.Eagle3(head, 5, VOCAB)
    kind.save(head, tmp_path / "final", _Tokenizer(), verifier=str(target_dir))
    return head, tmp_path / "final"


def test_head_records_its_training_depth(depth5_dir):
    _, src = depth5_dir
    config = json.loads((src / "config.json").read_text())
    assert config["ttt_steps"] == 5
    assert proposal_tokens(src) == 5
    assert Eagle3Head.from_pretrained(src).ttt_steps == 5


def test_export_writes_the_training_depth_and_the_flag_overrides_it(depth5_dir, tmp_path, capsys):
    head, src = depth5_dir
    out = export(src, "vllm", tmp_path / "vllm")
    assert proposal_tokens(out) == 5
    assert "speculative tokens" not in capsys.readouterr().err
    hf = export(src, "hf", tmp_path / "hf", speculative_tokens=2)
    assert proposal_tokens(hf) == 2
    assert json.loads((hf / "config.json").read_text())["ttt_steps"] == 5  # still the depth
    # Through SGLang and back: the depth travels in the SGLang config too.
    sgl = export(src, "sglang", tmp_path / "sgl")
    assert json.loads((sgl / "config.json").read_text())["ttt_steps"] == 5
    assert load_export(sgl, "sglang").ttt_steps == 5
    assert proposal_tokens(export(sgl, "vllm", tmp_path / "via")) == 5
    with pytest.raises(ExportError, match=r"--speculative-tokens must be an integer in \[1, 64\]"):
        export(src, "vllm", tmp_path / "zero", speculative_tokens=0)
    assert not (tmp_path / "zero").exists()


def test_cli_speculative_tokens(depth5_dir, tmp_path, capsys):
    _, src = depth5_dir
    out = tmp_path / "out"
    assert main(["--draft", str(src), "--format", "vllm", "--out", str(out)]) == 0
    assert '"num_speculative_tokens": 5, "method": "eagle3"' in capsys.readouterr().out
    argv = ["--draft", str(src), "--format", "vllm", "--out", str(out), "--overwrite"]
    assert main(argv + ["--speculative-tokens", "7"]) == 0
    assert '"num_speculative_tokens": 7, "method": "eagle3"' in capsys.readouterr().out
    assert proposal_tokens(out) == 7
    argv = ["--draft", str(src), "--format", "sglang", "--out", str(tmp_path / "sgl")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "--speculative-num-steps 5 " in printed
    assert "--speculative-num-draft-tokens 6" in printed


def test_speculative_tokens_from_the_recipe_else_3_with_a_note(head_dir, tmp_path, capsys):
    head, _ = head_dir
    assert head.ttt_steps is None  # saved without training: no recorded depth
    run = tmp_path / "run"
    head.save_pretrained(run / "final")
    (run / "recipe.yaml").write_text(yaml.safe_dump({"draft": {"ttt_steps": 7}}))
    assert proposal_tokens(export(run / "final", "vllm", tmp_path / "recipe")) == 7
    assert "speculative tokens" not in capsys.readouterr().err

    (run / "recipe.yaml").unlink()
    assert proposal_tokens(export(run / "final", "vllm", tmp_path / "default")) == 3
    assert "--speculative-tokens" in capsys.readouterr().err


# ----------------------------------------------------------------------------- draft types


def test_draft_types_detect_their_directories(head_dir, standalone_dir, tmp_path):
    from specdistill import drafts

    head, src = head_dir
    assert drafts.detect(src) is drafts.Eagle3
    assert drafts.Eagle3.detect(src) and not drafts.SGLangEagle3.detect(src)
    sgl = export(src, "sglang", tmp_path / "sgl")
    assert drafts.detect(sgl) is drafts.SGLangEagle3
    assert drafts.SGLangEagle3.name == "eagle3"
    assert drafts.detect(standalone_dir[2]) is drafts.Standalone
    assert drafts.detect(head) is drafts.Eagle3
    assert drafts.detect(standalone_dir[0]) is drafts.Standalone
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        drafts.detect(tmp_path / "empty")
    assert not drafts.Eagle3.detect(tmp_path / "empty")


def test_a_third_draft_type_plugs_in(standalone_dir, tmp_path, draft_registry):
    """A new type written unlike the others: a class in drafts/ (name, capabilities with its
    formats and export_as, layout, detect), registered, whose `exports` holds, per format it
    supports, a writer and a hint, and a reader of its layout: the export's tables take them
    from the registry, and nothing in train/export/ changes."""
    from specdistill import drafts
    from specdistill.drafts.export import Exports, Plan
    from specdistill.train.export import formats

    def write_toy(model, options):
        def write(out):
            (out / "config.json").write_text('{"toy": true}\n')

        return Plan(write, None, options.speculative_tokens or 1)

    class Toy:
        name, layout = "toy", "vllm"
        capabilities = drafts.Capabilities(formats=("vllm",), export_as="toy")
        exports = Exports(
            writers={"vllm": write_toy},
            readers={"vllm": lambda directory: torch.nn.Identity()},
            hints={"vllm": "toy-serve {out} {tokens}"},
        )

        @staticmethod
        def detect(path) -> bool:
            return json.loads((Path(path) / "config.json").read_text()).get("toy", False)

    assert "toy" not in formats.writers("vllm")
    draft_registry.register(0)(Toy)
    assert formats.writers("vllm")["toy"] is write_toy and "toy" not in formats.writers("sglang")
    src = tmp_path / "toy"
    src.mkdir()
    (src / "config.json").write_text('{"toy": true}\n')
    out = export(src, "vllm", tmp_path / "out")
    assert json.loads((out / "config.json").read_text()) == {"toy": True}
    assert isinstance(load_export(out, "vllm"), torch.nn.Identity)
    with pytest.raises(ExportError, match="cannot be exported as sglang"):
        export(src, "sglang", tmp_path / "sgl")
    assert not (tmp_path / "sgl").exists()
    assert main(["--draft", str(src), "--format", "vllm", "--out", str(tmp_path / "cli")]) == 0


def test_the_tables_hold_one_record_per_way_of_writing(draft_registry):
    """The tables are keyed by `export_as`: a type and its variants share one record; a type
    that claims another's key with a record of its own is refused."""
    from specdistill import drafts
    from specdistill.drafts.export import Exports
    from specdistill.train.export import formats

    ways = ["causal_lm", "eagle3_head", "parallel_lm", "reduced_causal_lm"]
    assert sorted(formats.writers("vllm")) == ways
    assert sorted(formats.writers("sglang")) == ["causal_lm", "eagle3_head", "reduced_causal_lm"]
    # hf is what vLLM loads, except a reduced head: hf keeps its K rows, which only this
    # project loads; vLLM gets the whole vocabulary's head (drafts/standalone/full_vocab.py)
    same = [way for way in ways if way != "reduced_causal_lm"]
    assert {w: formats.writers("hf")[w] for w in same} == {
        w: formats.writers("vllm")[w] for w in same
    }
    assert {w: formats.hints("hf")[w] for w in same} == {w: formats.hints("vllm")[w] for w in same}
    assert drafts.SGLangEagle3.exports is drafts.Eagle3.exports
    assert formats.readers("sglang")["eagle3_head"] is not formats.readers("vllm")["eagle3_head"]

    class Impostor(drafts.Standalone):
        exports = Exports(writers={}, readers={})

    draft_registry.register(95, variant=True)(Impostor)
    with pytest.raises(ValueError, match="both export as 'causal_lm'"):
        formats.writers("vllm")


def test_nothing_left_beside_out(head_dir, tmp_path):
    _, src = head_dir
    parent = tmp_path / "exports"
    export(src, "vllm", parent / "out")
    export(src, "sglang", parent / "out", overwrite=True)
    with pytest.raises(ExportError):
        export(src, "vllm", parent / "out")
    assert [p.name for p in parent.iterdir()] == ["out"]


# ----------------------------------------------------------------------------- parallel drafts


@pytest.mark.parametrize("fmt", ["vllm", "hf"])
def test_parallel_round_trip_keeps_its_mask_token(standalone_dir, tmp_path, fmt):
    from specdistill import drafts
    from specdistill.drafts.parallel import DEPTHS_FIELD, Parallel, add_mask_token, mask_token

    model, tokenizer, _ = standalone_dir
    draft = copy_of(model)
    mask_id = add_mask_token(draft)
    setattr(draft.config, DEPTHS_FIELD, 3)
    src = tmp_path / "src"
    Parallel(len(tokenizer), 3, mask_id).save(draft, src, tokenizer, "target")
    assert drafts.detect(src) is Parallel
    out = export(src, fmt, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["pard_token"] == mask_id == len(tokenizer)  # what vLLM's parallel drafting reads
    loaded = load_export(out, fmt)
    assert mask_token(loaded) == mask_id and drafts.detect(out) is Parallel
    ids = torch.tensor([[1, 2, 3, mask_id]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, draft(input_ids=ids).logits)
    with pytest.raises(ExportError, match="cannot be exported as sglang"):
        export(src, "sglang", tmp_path / "sgl")


def copy_of(model):
    import copy

    return copy.deepcopy(model)


def test_the_parallel_type_lives_in_its_folder():
    """Adding the parallel draft type touched only its folder, drafts/parallel/ (its export
    writer included), the drafts package's import of it and the recipe's type name and its
    one key: no other module names it, imports it or branches on it; the trainer, the engine,
    the server, the sweep and the export reach it through `drafts.TYPES`, `drafts.detect`,
    `drafts.type_of` and its `exports`."""
    recipe = {  # the recipe's type name and its one key (its section: recipe_draft.py)
        "train/recipe.py",
        "train/recipe_types.py",
        "train/recipe_checks.py",
        "train/recipe_draft.py",
    }
    found = []
    for path in sorted(ROOT.glob("*/**/*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.split("/")[0] in {"tests", "benchmarks", ".venv"} or rel.startswith("docs/"):
            continue
        text = path.read_text()
        if re.search(r'drafts\.parallel|\bParallel(Drafter)?\b|pard_token|"parallel"', text):
            found.append(rel)
    allowed = {"drafts/__init__.py"} | recipe  # the package imports each type (registration)
    outside = [
        rel for rel in found if not rel.startswith("drafts/parallel/") and rel not in allowed
    ]
    assert outside == [], outside
    assert "drafts/parallel/__init__.py" in found


def code_words(source: str) -> set[str]:
    """The identifiers and the words of the string constants of a module's code (its
    docstrings left out)."""
    import ast

    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                words |= set(re.findall(r"\w+", node.value))
        elif isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.alias):
            words |= set((node.asname or node.name).split("."))
        elif isinstance(node, ast.ImportFrom) and node.module:
            words |= set(node.module.split("."))
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            words.add(node.name)
    return words


def test_each_types_export_code_lives_in_its_own_folder():
    """A draft type's export writers, readers and serve hints are written in its own folder
    (drafts/<type>/) and reach the export through its `exports`: the verb and its tables
    (train/export/) and the drafts layer's shared export modules (drafts/export.py,
    drafts/verifier.py) import no type's folder and name no type, no type class and no
    `export_as` key in their code."""
    import inspect

    from specdistill.drafts import registry

    kinds = registry.detected()
    folders = {kind.__module__.split(".")[2] for kind in kinds}
    assert folders == {"standalone", "parallel", "eagle3"}
    named = (
        folders
        | {kind.name for kind in kinds}
        | {kind.__name__ for kind in kinds}
        | {kind.capabilities.export_as for kind in kinds}
        | {"Eagle3Head"}
    )
    generic = [*sorted((ROOT / "train" / "export").glob("*.py"))]
    generic += [ROOT / "drafts" / "export.py", ROOT / "drafts" / "verifier.py"]
    for path in generic:
        assert not code_words(path.read_text()) & named, path.relative_to(ROOT)
    for kind in kinds:
        rows = kind.exports
        for hook in [*rows.writers.values(), *rows.readers.values()]:
            where = Path(inspect.getfile(hook)).resolve().relative_to(ROOT)
            assert where.parts[0] == "drafts" and where.parts[1] in folders, (kind, where)
        assert set(rows.writers) >= set(kind.capabilities.formats), kind
        assert set(rows.hints) >= set(kind.capabilities.formats), kind
        assert kind.layout in rows.readers, kind
