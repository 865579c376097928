"""Sharded training (train/distributed.py, recipes/accelerate/).

What runs here, on CPUs: FSDP2 over gloo with 2 processes, launched with the shipped
recipes/accelerate/fsdp.yaml, against one process. DeepSpeed, several machines and GPUs are
not run: their configs are only parsed.
"""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specdistill.train.config import RecipeError, load_recipe
from specdistill.train.distributed import check_layout, is_sharded, layout
from specdistill.train.trainer import Trainer
from tests.processes import free_port, run_bounded, why_failed

REPO = Path(__file__).parents[2]
CONFIGS = REPO / "recipes" / "accelerate"


@pytest.mark.parametrize(
    "name, distributed_type, machines",
    [
        ("ddp.yaml", DistributedType.MULTI_GPU, 1),
        ("cpu.yaml", DistributedType.NO, 1),
        ("fsdp.yaml", DistributedType.FSDP, 1),
        ("fsdp_multinode.yaml", DistributedType.FSDP, 2),
        ("deepspeed_zero2.yaml", DistributedType.DEEPSPEED, 1),
        ("deepspeed_zero3.yaml", DistributedType.DEEPSPEED, 1),
    ],
)
def test_shipped_accelerate_configs_load_as_claimed(name, distributed_type, machines):
    path = CONFIGS / name
    config = load_config_from_file(str(path))
    assert config.distributed_type == distributed_type
    assert config.num_machines == machines
    assert config.mixed_precision == "no"  # precision is the recipe's (train.mixed_precision)
    header = path.read_text().split("\ncompute_environment:")[0]
    assert f"accelerate launch --config_file recipes/accelerate/{name}" in header
    assert "train/distill.py" in header
    if distributed_type == DistributedType.FSDP:
        assert config.fsdp_config["fsdp_version"] == 2
    if distributed_type == DistributedType.DEEPSPEED:
        stage = int(name.removesuffix(".yaml")[-1])
        assert config.deepspeed_config["zero_stage"] == stage
        assert config.deepspeed_config["gradient_accumulation_steps"] == 1
        # equal to the recipe default train.max_grad_norm, as check_layout requires
        assert config.deepspeed_config["gradient_clipping"] == load_recipe(None).train.max_grad_norm
        if stage == 3:
            assert config.deepspeed_config["zero3_save_16bit_model"] is True
            assert config.deepspeed_config["zero3_init_flag"] is False
    if machines > 1:
        assert config.main_process_ip and config.main_process_port


def fake_accelerator(kind, processes=8, **plugin):
    state = SimpleNamespace(
        deepspeed_plugin=SimpleNamespace(
            zero_stage=plugin.get("zero_stage", 2),
            deepspeed_config={"gradient_clipping": plugin.get("clip", 1.0)},
        ),
        fsdp_plugin=SimpleNamespace(fsdp_version=2),
    )
    return SimpleNamespace(distributed_type=kind, num_processes=processes, state=state)


def test_deepspeed_layouts_refuse_what_the_trainer_cannot_do():
    zero2 = fake_accelerator(DistributedType.DEEPSPEED)
    check_layout(zero2, accum=1, max_grad_norm=1.0)
    with pytest.raises(RecipeError, match=r"train.micro_batch_size to .* processes \(8\)"):
        check_layout(zero2, accum=2, max_grad_norm=1.0)
    with pytest.raises(RecipeError, match="gradient_clipping = 1.0 .* train.max_grad_norm = 0.5"):
        check_layout(zero2, accum=1, max_grad_norm=0.5)
    fsdp = fake_accelerator(DistributedType.FSDP)
    check_layout(fsdp, accum=4, max_grad_norm=0.5, chunk_size=64)
    fsdp.state.fsdp_plugin.fsdp_version = 1
    with pytest.raises(RecipeError, match="loss.chunk_size under FSDP needs FSDP2"):
        check_layout(fsdp, accum=1, max_grad_norm=1.0, chunk_size=64)
    assert layout(fsdp) == "FSDP1"
    assert not is_sharded(zero2) and layout(zero2) == "DeepSpeed ZeRO-2"
    check_layout(zero2, accum=1, max_grad_norm=1.0, chunk_size=64)
    zero3 = fake_accelerator(DistributedType.DEEPSPEED, zero_stage=3)
    check_layout(zero3, accum=1, max_grad_norm=1.0)
    with pytest.raises(RecipeError, match="loss.chunk_size is not supported with DeepSpeed ZeRO-3"):
        check_layout(zero3, accum=1, max_grad_norm=1.0, chunk_size=64)
    assert is_sharded(zero3) and layout(zero3) == "DeepSpeed ZeRO-3"
    fsdp = fake_accelerator(DistributedType.FSDP)
    assert is_sharded(fsdp) and layout(fsdp) == "FSDP2"
    ddp = fake_accelerator(DistributedType.MULTI_CPU, processes=2)
    assert not is_sharded(ddp) and layout(ddp) == "DDP"


@pytest.fixture(scope="module")
def tied_draft(tiny_pair, tmp_path_factory):
    """A 2-layer draft of the tiny pair's tokenizer whose output head is its input embedding,
    as in most small drafts (Qwen2.5-0.5B, Llama-3.2-1B, embedded:code-draft)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[1])
    torch.manual_seed(2)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    root = tmp_path_factory.mktemp("tied_draft")
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def run_overrides(tiny_pair, draft, out: Path) -> list[str]:
    target, _, data = tiny_pair
    settings = {
        "target.model": target,
        "draft.model": draft,
        "data.train": data / "*.py",
        "data.max_length": 32,
        "data.eval_fraction": 0.25,
        "train.max_steps": 4,
        "train.global_batch_size": 4,
        "train.micro_batch_size": 1,  # 2 micro-batches per process: FSDP's no_sync path
        "train.warmup_steps": 2,
        "train.lr": 3e-3,
        "train.output_dir": out,
        "train.save_every": 2,  # a sharded checkpoint is written by both processes
        "train.log_every": 1,
        # 9 sequences: 5 on process 0, 4 on process 1: eval_batches must top process 1 up,
        # or process 0's fifth sharded forward waits forever.
        "eval.max_sequences": 9,
        "eval.every": 0,
        "eval.tau_prompts": 2,
        "eval.tau_tokens": 16,
        # the speculative eval decodes on the main process alone: the draft is gathered
        "eval.speculative.every": 2,
        "eval.speculative.gammas": "[1, 3]",
        "eval.speculative.prompts": 2,
        "eval.speculative.prompt_tokens": 8,
        "eval.speculative.max_new_tokens": 8,
        # the chunked loss reads the draft's output head, sharded by FSDP
        "loss.name": "lk_lambda",
        "loss.chunk_size": 7,
    }
    return [f"{k}={v}" for k, v in settings.items()]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_fsdp2_over_gloo_with_two_processes_trains_as_one_process(tiny_pair, tied_draft, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    Trainer.from_recipe(load_recipe(None, run_overrides(tiny_pair, tied_draft, one))).run()

    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CONFIGS / "fsdp.yaml"),
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        str(REPO / "train" / "distill.py"),
        *run_overrides(tiny_pair, tied_draft, two),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    # a hang (a forward that only some processes run) fails here instead of blocking the suite
    proc = run_bounded(cmd, env=env, timeout=300)
    assert proc.returncode == 0, why_failed(proc)
    # FSDP2 really ran (accelerate alone would have fallen back to DDP on CPUs) ...
    assert "2 process(es) (FSDP2)" in proc.stdout
    # ... and its checkpoints are sharded (torch.distributed.checkpoint), written by both
    assert (two / "checkpoints" / "step-0000004" / "pytorch_model_fsdp_0").is_dir()

    m1, m2 = metrics(one), metrics(two)
    steps1 = [m for m in m1 if "loss" in m]
    steps2 = [m for m in m2 if "loss" in m]
    assert [m["step"] for m in steps2] == [m["step"] for m in steps1] == [1, 2, 3, 4]
    assert [m["tokens"] for m in steps2] == [m["tokens"] for m in steps1]
    for key in ("loss", "alpha", "grad_norm"):
        assert [m[key] for m in steps2] == pytest.approx([m[key] for m in steps1], rel=1e-5), key
    evals1 = [m["eval/alpha"] for m in m1 if "eval/alpha" in m]
    evals2 = [m["eval/alpha"] for m in m2 if "eval/alpha" in m]
    assert len(evals1) == 2  # before and after
    assert evals2 == pytest.approx(evals1, rel=1e-5)
    assert [m["step"] for m in m2 if "spec/best_gamma" in m] == [2, 4]

    # final/ holds the whole draft, gathered from the shards, equal to one process's
    a = load_file(one / "final" / "model.safetensors")
    b = load_file(two / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert b[name].shape == a[name].shape, name
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)
    reloaded = LlamaForCausalLM.from_pretrained(two / "final")
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
