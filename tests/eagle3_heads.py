"""EAGLE-3 heads on tiny random targets (Llama or Qwen2, 64 tokens), built in the test process:
`tiny_target` and `head_for` for the head's own tests, `trained_head` (a non-trivial vocabulary
map, every weight moved off its init) for export and interop."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specdistill.drafts.eagle3.head import Eagle3Head, build_vocab_map

VOCAB, DRAFT_VOCAB, HIDDEN = 64, 40, 32


def tiny_config(cls, layers: int = 4):
    return cls(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )


def tiny_target(family: str = "llama", seed: int = 0, layers: int = 4):
    torch.manual_seed(seed)
    if family == "qwen2":
        return Qwen2ForCausalLM(tiny_config(Qwen2Config, layers)).eval()
    return LlamaForCausalLM(tiny_config(LlamaConfig, layers)).eval()


def head_for(target, draft_vocab_size=DRAFT_VOCAB, seed=1, **kwargs) -> Eagle3Head:
    head = Eagle3Head.from_target(target, draft_vocab_size=draft_vocab_size, **kwargs)
    counts = torch.randint(0, 1000, (VOCAB,), generator=torch.Generator().manual_seed(seed))
    head.set_vocab_map(*build_vocab_map(counts, draft_vocab_size))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # move away from the init so that every weight matters
        for p in head.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return head.eval()


def trained_head(target, seed: int = 0, **kwargs) -> Eagle3Head:
    """A head with a non-trivial vocab map and every weight randomly moved off its init."""
    torch.manual_seed(seed)
    head = Eagle3Head.from_target(target, draft_vocab_size=DRAFT_VOCAB, **kwargs)
    counts = torch.randint(0, 1000, (VOCAB,))
    d2t, t2d = build_vocab_map(counts, DRAFT_VOCAB)
    assert d2t.any() and not torch.equal(t2d, torch.arange(VOCAB) < DRAFT_VOCAB)
    head.set_vocab_map(d2t, t2d, target.get_output_embeddings().weight)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return head.eval()
