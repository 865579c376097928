"""Tiny tokenizers built in the test process (no downloads), for the data tests."""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
CHATML_SPECIAL = ["<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "def f(x):\n    return x + 1\n\nclass A:\n    pass\n",
    "user assistant system: what is the answer? there is none.",
]


def make_tokenizer(
    chat_template: str | None = CHATML,
    special_tokens: list[str] = CHATML_SPECIAL,
    vocab_size: int = 300,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style) trained on a few strings, wrapped for transformers.

    eos_token and pad_token are `<|endoftext|>` (id 0); `special_tokens` follow from id 1.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, *special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=list(special_tokens),
    )
    hf.chat_template = chat_template
    return hf
