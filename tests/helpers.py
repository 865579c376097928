"""Plain helpers shared by the test folders: a tiny byte-level tokenizer, tiny Llama models and
a peft LoRA adapter, all built in the test process (no downloads).

The session fixtures built from them (`tiny_pair`, ...) are in tests/conftest.py.
"""

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\nprint(os.getcwd(), sys.argv)\n",
]


def make_tokenizer(vocab_size: int = 320, corpus: list[str] = TEXT) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
    )


def make_model(
    tokenizer, *, hidden: int, layers: int, seed: int, init: float = 0.02, positions: int = 128
) -> LlamaForCausalLM:
    """A random Llama over `tokenizer`; `init`: the weights' standard deviation
    (LlamaConfig's initializer_range, 0.02 its default)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        initializer_range=init,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def save_sharp_target(tokenizer, out, *, hidden: int, layers: int, positions: int = 128):
    """A Llama target with peaked, context-dependent distributions (a default-init random
    target is near uniform, leaving a draft nothing to learn), saved with `tokenizer` to
    `out`; -> `out`."""
    model = make_model(
        tokenizer, hidden=hidden, layers=layers, seed=5, init=0.15, positions=positions
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_lora_adapter(base_dir, out_dir, *, scale: float = 1.0, seed: int = 0):
    """A random, non-trivially initialised peft LoRA adapter on the model at `base_dir`
    (attention, MLP and lm_head), saved unmerged at `out_dir`; B scaled by `scale`."""
    from peft import LoraConfig, get_peft_model

    base = LlamaForCausalLM.from_pretrained(base_dir)
    base.name_or_path = str(base_dir)  # recorded as base_model_name_or_path
    torch.manual_seed(seed)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=modules + ["lm_head"], init_lora_weights=False
    )
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1).mul_(scale)
            elif "lora_A" in name:
                param.normal_(0.0, 0.1)
    model.save_pretrained(out_dir)
    return out_dir


def hf_greedy(model, tokenizer, ids: list[int], n: int) -> list[int]:
    """The target's own greedy continuation of `ids` (n tokens) through transformers'
    `generate`: what a lossless engine must reproduce."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return out[0, len(ids) :].tolist()
