"""Interop with the real `speculators` package (0.9.0): it accepts our vLLM export as its own.

Needs the package (not a project dependency: its metadata pins torchvision / torchaudio); run
`bash benchmarks/speculators_interop.sh`, which installs it in an isolated virtualenv and runs
`python -m pytest -m interop tests/interop -q`. Skipped when the package is not importable.
"""

import json

import pytest
import torch

speculators = pytest.importorskip("speculators")

from speculators import SpeculatorModel, SpeculatorModelConfig  # noqa: E402
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig  # noqa: E402

from specdistill.drafts.eagle3.head import SPECULATORS_VERSION, Eagle3Head  # noqa: E402
from specdistill.train.export import export  # noqa: E402
from tests.eagle3_heads import HIDDEN, VOCAB, tiny_config, trained_head  # noqa: E402

pytestmark = pytest.mark.interop

T = 128  # flex attention's block size: the package's default attention needs a multiple


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(our head, the tiny target, the target's dir = the verifier, the vllm export)."""
    root = tmp_path_factory.mktemp("interop")
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_config(LlamaConfig)).eval()
    target.save_pretrained(root / "target")
    head = trained_head(target)
    head.save_pretrained(root / "head", verifier=str(root / "target"))
    out = export(root / "head", "vllm", root / "vllm")
    return head, target, root / "target", out


def load_config(out, attn: str | None = None) -> Eagle3SpeculatorConfig:
    config = SpeculatorModelConfig.from_pretrained(str(out))
    if attn is not None:
        config.transformer_layer_config._attn_implementation = attn
    return config


def test_installed_version_is_the_one_we_write():
    from importlib.metadata import version

    assert version("speculators") == SPECULATORS_VERSION


def test_package_config_class_accepts_every_field(exported):
    head, _, target_dir, out = exported
    ours = json.loads((out / "config.json").read_text())
    config = load_config(out)
    assert type(config) is Eagle3SpeculatorConfig
    assert config.speculators_model_type == "eagle3"
    assert config.architectures == ["Eagle3Speculator"]
    assert config.draft_vocab_size == head.draft_vocab_size
    assert config.target_hidden_size == head.target_hidden_size
    assert config.eagle_aux_hidden_state_layer_ids == head.aux_layers
    assert config.norm_before_residual is head.norm_before_residual
    assert (config.norm_before_fc, config.fc_norm, config.norm_output) == (False, False, False)
    assert config.embed_requires_grad is False
    assert config.target_vocab_size == VOCAB
    layer = config.transformer_layer_config
    assert type(layer) is LlamaConfig  # from model_type: the package's default would be Qwen3
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "vocab_size",
        "hidden_act",
        "max_position_embeddings",
        "rope_parameters",
        "attention_bias",
        "mlp_bias",
    ):
        assert getattr(layer, key) == getattr(head.config, key), key
    assert layer.num_hidden_layers == 1
    spec = config.speculators_config
    assert spec.algorithm == "eagle3" and spec.default_proposal_method == "greedy"
    assert spec.proposal_methods[0].proposal_type == "greedy"
    assert spec.verifier.name_or_path == str(target_dir)
    assert spec.verifier.architectures == ["LlamaForCausalLM"]
    # Every field the package defines beyond PretrainedConfig's generic ones is in the file:
    # its defaults are not ours to rely on (norm_before_residual: False there, True in vLLM).
    generic = set(PretrainedConfig().to_dict())
    assert set(Eagle3SpeculatorConfig.model_fields) - generic - set(ours) == set()


def test_package_model_loads_our_weights(exported):
    head, target, _, out = exported
    model = SpeculatorModel.from_pretrained(str(out), config=load_config(out, "sdpa"))
    assert type(model) is Eagle3DraftModel
    theirs, ours = model.state_dict(), head.state_dict()
    assert set(ours) <= set(theirs)
    assert set(theirs) - set(ours) == {"verifier_lm_head.weight", "verifier_norm.weight"}
    for key, value in ours.items():
        assert theirs[key].dtype == value.dtype and torch.equal(theirs[key], value), key
    # The package orders draft ids as the target ids of t2d, ascending (lm_head[t2d]): the
    # verifier head it builds must be the target's rows at our draft ids, in our order.
    expected = target.get_output_embeddings().weight[head.draft_ids()]
    assert torch.equal(model.verifier_lm_head.weight, expected)


@pytest.mark.parametrize("attn", ["sdpa", "simple_flex_attention"])
def test_package_forward_matches_our_logits(exported, attn):
    """Its training-time forward (teacher-forced TTT) gives our `unroll` logits, every step."""
    head, _, _, out = exported
    model = Eagle3DraftModel.from_pretrained(str(out), config=load_config(out, attn)).eval()
    g = torch.Generator().manual_seed(11)
    features = torch.randn(1, T, 3 * HIDDEN, generator=g)
    ids = torch.randint(0, VOCAB, (1, T), generator=g)
    steps = 3
    with torch.no_grad():
        ours = head.unroll(features, ids, None, steps)
        logits = []
        hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o))
        try:
            # The package takes the already shifted tokens (position t holds token t+1) and
            # counts positions from where it is told; ours starts at 0 (vLLM's convention).
            model(
                hidden_states=features,
                input_ids=torch.nn.functional.pad(ids[:, 1:], (0, 1)),
                document_ids=torch.zeros(1, T, dtype=torch.long),
                position_ids=torch.arange(T)[None],
                ttt_steps=steps,
            )
        finally:
            hook.remove()
    assert len(logits) == steps
    for k, (a, b) in enumerate(zip(ours, logits, strict=True)):
        valid = T - k - 1  # later entries read tokens past the end: garbage in both
        torch.testing.assert_close(b[:, :valid], a[:, :valid], rtol=0, atol=1e-5)


def test_full_vocab_head_loads_without_a_map(exported, tmp_path):
    """draft_vocab_size == V: the package keeps no d2t / t2d; ours (identity) are ignored."""
    _, target, target_dir, _ = exported
    head = Eagle3Head.from_target(target)  # draft vocab = V
    head.save_pretrained(tmp_path / "head", verifier=str(target_dir))
    out = export(tmp_path / "head", "vllm", tmp_path / "vllm")
    model = SpeculatorModel.from_pretrained(str(out), config=load_config(out, "sdpa"))
    assert model.d2t is None and model.t2d is None
    assert not head.d2t.any()  # identity: dropping it changes nothing
    assert torch.equal(model.lm_head.weight, head.lm_head.weight)
