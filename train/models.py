"""Loading the target / draft pair through the ordinary Hugging Face path.

`embedded:<name>` resolves to a locally built model directory (train/embedded.py); any
other string is a Hugging Face model id or a local directory, loaded the same way.
"""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdistill.train.embedded import resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TokenizerMismatchError(ValueError):
    """Target and draft do not share a tokenizer, so draft tokens cannot be verified."""


def load_tokenizer(name: str, revision: str | None = None):
    return AutoTokenizer.from_pretrained(resolve_model(name), revision=revision)


def load_model(name: str, *, dtype: str = "float32", revision: str | None = None):
    return AutoModelForCausalLM.from_pretrained(
        resolve_model(name), dtype=DTYPES[dtype], revision=revision
    )


def load_draft(name: str, *, dtype: str = "float32", revision: str | None = None):
    """A standalone draft (like `load_model`) or an EAGLE-3 head directory (train/eagle3.py)."""
    from specdistill.train.eagle3 import Eagle3Head, is_eagle3_dir

    path = resolve_model(name)
    if is_eagle3_dir(path):
        return Eagle3Head.from_pretrained(path, dtype=DTYPES[dtype])
    return load_model(name, dtype=dtype, revision=revision)


def check_tokenizers(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Raise `TokenizerMismatchError` unless both tokenizers map every string to the same ids."""
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    problems = []
    if t_vocab != d_vocab:
        only_t = len(t_vocab.keys() - d_vocab.keys())
        only_d = len(d_vocab.keys() - t_vocab.keys())
        moved = [tok for tok in t_vocab.keys() & d_vocab.keys() if t_vocab[tok] != d_vocab[tok]]
        problems.append(
            f"vocabularies differ ({len(t_vocab)} vs {len(d_vocab)} tokens; {only_t} only in the "
            f"target, {only_d} only in the draft, {len(moved)} with different ids"
            + (f", e.g. {moved[0]!r}: {t_vocab[moved[0]]} vs {d_vocab[moved[0]]}" if moved else "")
            + ")"
        )
    if target_tok.eos_token_id != draft_tok.eos_token_id:
        problems.append(
            f"eos token ids differ ({target_tok.eos_token_id} vs {draft_tok.eos_token_id})"
        )
    if problems:
        raise TokenizerMismatchError(
            f"target '{target_name}' and draft '{draft_name}' do not share a tokenizer: "
            + "; ".join(problems)
            + ". A draft must use its target's tokenizer: pick a draft from the same model family "
            "(e.g. Qwen2.5-0.5B for Qwen2.5-7B)."
        )


def shared_vocab_size(target, draft, tokenizer) -> int:
    """Logit columns compared between the models: the ids the tokenizer can produce.

    Model families pad their output heads differently (Qwen2.5-0.5B: 151936 rows,
    Qwen2.5-7B: 152064); columns past len(tokenizer) are never sampled by the verifier.
    """
    n = len(tokenizer)
    for role, model in (("target", target), ("draft", draft)):
        if model is None:  # an EAGLE-3 head is built on the target's vocabulary
            continue
        rows = model.get_output_embeddings().weight.shape[0]
        if rows < n:
            raise TokenizerMismatchError(
                f"the {role}'s output head has {rows} rows but the tokenizer has {n} tokens"
            )
    return n
