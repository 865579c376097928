"""Loading is all or nothing (models/weights.py): a draft, a head, an export or a checkpoint
whose weights do not cover its config is refused, naming the tensors; a cut-short weights
file is a one-line error naming it; `train.resume: no` means no."""

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaForCausalLM

from specdistill.drafts.eagle3.head import Eagle3Head
from specdistill.drafts.loader import load_draft
from specdistill.models.hub import BrokenWeightsError, IncompleteDraftError, load_target
from specdistill.train.config import RecipeError, load_recipe
from specdistill.train.export_cli import main as export_main
from tests.train.helpers import Killed, kill_at, one_line_error, seven_layer_config, train

TOKENIZER = ("tokenizer.json", "tokenizer_config.json")


def cut_short(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


@pytest.fixture
def seven(tiny_pair, tmp_path) -> Path:
    return seven_layer_config(tiny_pair[1], tmp_path / "seven")


# ----------------------------------------------------------------------------- models.hub


def test_a_draft_whose_weights_do_not_cover_its_config_is_refused(seven):
    with pytest.raises(IncompleteDraftError) as error:
        load_draft(str(seven))
    message = str(error.value)
    assert isinstance(error.value, ValueError) and "\n" not in message
    assert str(seven) in message
    assert "54 tensors missing" in message  # 6 layers x 9 tensors
    assert "model.layers.1.input_layernorm.weight" in message and "(54 in all)" in message


def test_unexpected_and_other_shaped_weights_are_refused(tiny_pair, tmp_path):
    fewer = shutil.copytree(tiny_pair[0], tmp_path / "fewer")  # 2-layer weights, 1-layer config
    config = json.loads((fewer / "config.json").read_text())
    (fewer / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(IncompleteDraftError, match=r"9 not in the config \(model\.layers\.1\."):
        load_draft(str(fewer))
    load_target(str(fewer))  # a target's unused weights are logged, not refused

    wider = shutil.copytree(tiny_pair[1], tmp_path / "wider")
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    for load in (load_draft, load_target):
        with pytest.raises(IncompleteDraftError) as error:
            load(str(wider))
        assert "3 of another shape" in str(error.value)
        assert "model.layers.0.mlp.up_proj.weight (32, 16) vs (40, 16)" in str(error.value)


def test_a_tied_head_is_not_missing(tiny_pair, tmp_path):
    config = AutoConfig.from_pretrained(tiny_pair[1], tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tied")
    model = load_draft(str(tmp_path / "tied"))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_a_cut_short_weights_file_is_a_one_line_error(tiny_pair, tmp_path, tiny_head_dir):
    draft = shutil.copytree(tiny_pair[1], tmp_path / "draft")
    weights = cut_short(draft / "model.safetensors")
    with pytest.raises(BrokenWeightsError) as error:
        load_draft(str(draft))
    assert str(weights) in str(error.value) and "\n" not in str(error.value)

    head = shutil.copytree(tiny_head_dir, tmp_path / "head")
    weights = cut_short(head / "model.safetensors")
    with pytest.raises(BrokenWeightsError, match="cut short") as error:
        load_draft(str(head))
    assert str(weights) in str(error.value)


def test_an_eagle3_head_is_loaded_all_or_nothing(tiny_head_dir, tmp_path):
    assert isinstance(load_draft(str(tiny_head_dir)), Eagle3Head)
    wider = shutil.copytree(tiny_head_dir, tmp_path / "wider")
    config = json.loads((wider / "config.json").read_text())
    config["transformer_layer_config"]["intermediate_size"] += 8
    (wider / "config.json").write_text(json.dumps(config))
    with pytest.raises(IncompleteDraftError, match="3 of another shape") as error:
        load_draft(str(wider))
    assert "layers.0.mlp.up_proj.weight" in str(error.value) and str(wider) in str(error.value)

    partial = shutil.copytree(tiny_head_dir, tmp_path / "partial")
    state = load_file(partial / "model.safetensors")
    del state["norm.weight"], state["fc.weight"]
    save_file(state, partial / "model.safetensors")
    with pytest.raises(IncompleteDraftError, match=r"2 tensors missing \(fc.weight, norm.weight\)"):
        load_draft(str(partial))


def test_a_target_adapter_missing_lora_tensors_is_refused(tiny_pair, tmp_path):
    from tests.helpers import make_lora_adapter

    adapter = make_lora_adapter(tiny_pair[0], tmp_path / "adapter")
    load_target(str(tiny_pair[0]), str(adapter))
    weights = adapter / "adapter_model.safetensors"
    state = load_file(weights)
    del state["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"]
    save_file(state, weights)
    with pytest.raises(IncompleteDraftError) as error:
        load_target(str(tiny_pair[0]), str(adapter))
    assert "1 tensors missing (base_model.model.model.layers.1.mlp.up_proj.lora_B.weight)" in str(
        error.value
    )
    cut_short(weights)
    with pytest.raises(BrokenWeightsError, match="adapter_model.safetensors"):
        load_target(str(tiny_pair[0]), str(adapter))


# ----------------------------------------------------------------------------- export


def test_export_refuses_a_draft_whose_weights_do_not_cover_its_config(seven, tmp_path, capsys):
    out = tmp_path / "out"
    assert export_main(["--draft", str(seven), "--format", "vllm", "--out", str(out)]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "54 tensors missing" in line and "model.layers.1.input_layernorm.weight" in line
    assert str(seven) in line
    assert not out.exists()


@pytest.mark.parametrize("kind", ["standalone", "eagle3"])
def test_export_of_a_cut_short_weights_file_is_a_one_line_error(
    kind, tiny_pair, tiny_head_dir, tmp_path, capsys
):
    draft = shutil.copytree(tiny_pair[1] if kind == "standalone" else tiny_head_dir, tmp_path / "d")
    weights = cut_short(draft / "model.safetensors")
    for fmt in ("vllm", "sglang"):
        out = tmp_path / fmt
        assert export_main(["--draft", str(draft), "--format", fmt, "--out", str(out)]) == 2
        line = one_line_error(capsys.readouterr().err)
        assert str(weights) in line and "cut short" in line
        assert not out.exists()


def test_export_of_a_standalone_draft_needs_a_tokenizer(tiny_pair, tiny_head_dir, tmp_path, capsys):
    draft = shutil.copytree(tiny_pair[1], tmp_path / "draft")
    for name in TOKENIZER:
        (draft / name).unlink()
    out = tmp_path / "out"
    assert export_main(["--draft", str(draft), "--format", "vllm", "--out", str(out)]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "no tokenizer files" in line and "tokenizer.json" in line and "--tokenizer" in line
    assert not out.exists()

    target = str(tiny_pair[0])
    argv = ["--draft", str(draft), "--format", "vllm", "--out", str(out), "--tokenizer", target]
    assert export_main(argv) == 0
    for name in TOKENIZER:
        assert (out / name).read_bytes() == (tiny_pair[0] / name).read_bytes()
    load_draft(str(out))

    out = tmp_path / "head"  # a head: the engines take the verifier's tokenizer; a note
    assert export_main(["--draft", str(tiny_head_dir), "--format", "vllm", "--out", str(out)]) == 0
    assert "no complete tokenizer" in capsys.readouterr().err


# ----------------------------------------------------------------------------- resume


def test_a_checkpoint_that_does_not_cover_the_draft_falls_back_naming_the_tensors(
    tiny_pair, tmp_path, monkeypatch, capsys
):
    extra = {"train.max_steps": 10, "train.save_every": 4}
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        kill_at(m, 9)
        with pytest.raises(Killed):
            train(tiny_pair, out, **extra)
    newest = out / "checkpoints" / "step-0000008" / "model.safetensors"
    state = load_file(newest)
    del state["model.norm.weight"]
    save_file(state, newest, metadata={"format": "pt"})
    capsys.readouterr()
    resumed = train(tiny_pair, out, **extra, **{"train.resume": "auto"})
    err = capsys.readouterr().err
    warning = next(line for line in err.splitlines() if "cannot load checkpoint" in line)
    assert "step-0000008" in warning and "IncompleteDraftError" in warning
    assert "1 tensors missing (model.norm.weight)" in warning
    assert "previous complete checkpoint" in err and "step-0000004" in err
    assert resumed.step == 10


# ----------------------------------------------------------------------------- train.resume


@pytest.mark.parametrize("written", ["no", "false", "off", "'no'"])
def test_train_resume_no_as_yaml_reads_it(written, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"train:\n  resume: {written}\n  max_steps: 3\n")
    assert load_recipe(recipe).train.resume == "no"
    assert load_recipe(None, [f"train.resume={written}"]).train.resume == "no"


def test_train_resume_true_is_refused_naming_the_accepted_values():
    for override in ("train.resume=yes", "train.resume=true"):
        with pytest.raises(RecipeError) as error:
            load_recipe(None, [override])
        assert "no (or false), auto, or the path of a checkpoint directory" in str(error.value)
        assert "write auto" in str(error.value)
    assert load_recipe(None, ["train.resume=auto"]).train.resume == "auto"
