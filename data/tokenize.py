"""Records → token ids and a loss mask, one pair per record.

Text: the document's tokens (no special tokens added) followed by the tokenizer's EOS, all
of them loss tokens.

Chat: the conversation rendered by the tokenizer's chat template and tokenised as
`apply_chat_template(..., tokenize=True)` would. The loss mask is True exactly on what the
model emits in assistant turns: the content and the end-of-turn token (`<|im_end|>`,
`<|eot_id|>`, `<end_of_turn>`), not the role header and not the template's separator
after the end-of-turn token (ChatML's trailing newline). The one exception is a token that
holds both assistant and template characters (step 2 below): it is a loss token.

How the assistant tokens are found, for any template:
1. For assistant message i, render messages[:i] with the generation prompt (ends just after
   the assistant header) and messages[:i+1] (ends after the turn). Both must be string
   prefixes of the full rendering, otherwise the template rewrites earlier turns depending
   on what follows (not prefix-stable) and the record is rejected rather than mis-masked.
   The two lengths bound the turn's characters.
2. Tokenise the full rendering once with offsets and take the tokens that hold any of the
   turn's characters. A token may straddle a bound: byte-level BPE merges the newline that
   ends the assistant header with the spaces, tabs or newlines that start a reply (code
   replies start with indentation), and text that ends one turn with what starts the next.
   Such a token holds an assistant character, so it belongs to the turn and is a training
   target: the masked tokens then decode to the whole reply, preceded by at most a little
   of the header (e.g. "\n    return x<|im_end|>").
3. Drop the turn's tokens after its last special token (the end-of-turn token): they are
   template separators. A turn with no special token keeps all its tokens, a token
   straddling its end included.

A conversation that carries the token ids it was generated as (`TokenIds`, written by
`specdistill prepare`) is those ids: the prompt's, then the answer's, the answer's all loss
tokens (its end-of-turn token included). A non-canonical split the sampler drew stays as
drawn, which the text would not reproduce. The ids are used only where this tokenizer
encodes the conversation's prompt (its messages before the answer, rendered with the
generation prompt) to exactly the recorded prompt ids and knows every answer id; otherwise
(another tokenizer or template made them) the record is tokenized from its text, and a
warning counts such records.

Limits: a conversation may not start with an assistant message (the empty conversation
before it cannot be rendered). A template that writes role headers but ignores
add_generation_prompt would leave the assistant header inside the masked turn; ChatML,
Llama 3, Gemma and Mistral templates do not do that.
"""

import itertools
import logging
from typing import NamedTuple

import numpy as np

from specdistill.data.records import ChatRecord, DataError, Record, TextRecord

BATCH = 1024  # records per tokenizer call: fast tokenizers encode a batch in parallel
logger = logging.getLogger(__name__)


class Tokens(NamedTuple):
    ids: np.ndarray  # [L] int32
    mask: np.ndarray  # [L] bool, True on training targets


def tokenize_records(tokenizer, records: list[Record]) -> list[Tokens | DataError]:
    """One `Tokens` per record, in order; a record that cannot be masked gives its DataError."""
    out: list[Tokens | DataError | None] = [None] * len(records)
    texts = [i for i, r in enumerate(records) if isinstance(r, TextRecord)]
    chats = [i for i, r in enumerate(records) if isinstance(r, ChatRecord)]
    if texts:
        text_tokens = tokenize_texts(tokenizer, [records[i].text for i in texts])
        for i, tokens in zip(texts, text_tokens, strict=True):
            out[i] = tokens
    if chats:
        chat_tokens = tokenize_chats(tokenizer, [records[i] for i in chats])
        for i, tokens in zip(chats, chat_tokens, strict=True):
            out[i] = tokens
    return out


def tokenize_texts(tokenizer, texts: list[str]) -> list[Tokens]:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(
            "the tokenizer has no eos_token, which separates text documents; "
            "set tokenizer.eos_token"
        )
    out = []
    for start in range(0, len(texts), BATCH):
        encoded = _encode(tokenizer, texts[start : start + BATCH])
        for ids in encoded["input_ids"]:
            ids = np.array([*ids, eos], dtype=np.int32)
            out.append(Tokens(ids, np.ones(len(ids), dtype=bool)))
    return out


def tokenize_chats(tokenizer, records: list[ChatRecord]) -> list[Tokens | DataError]:
    if tokenizer.chat_template is None:
        raise DataError(
            f"{records[0].origin}: chat records need a tokenizer with a chat template, and "
            "this one has none; use the tokenizer of the model's chat/instruct variant or "
            "set tokenizer.chat_template"
        )
    if not tokenizer.is_fast:
        raise DataError(
            "chat masking maps characters to tokens through offsets, which needs a fast "
            "tokenizer; load it with AutoTokenizer.from_pretrained(..., use_fast=True)"
        )
    special = np.array(sorted(special_token_ids(tokenizer)), dtype=np.int64)
    out: list[Tokens | DataError | None] = generated_tokens(tokenizer, records)
    rendered = []  # (index, text, spans)
    for i, record in enumerate(records):
        if out[i] is not None:
            continue
        try:
            rendered.append((i, *render_with_spans(tokenizer, record)))
        except DataError as exc:
            out[i] = exc
    for start in range(0, len(rendered), BATCH):
        chunk = rendered[start : start + BATCH]
        encoded = _encode(tokenizer, [text for _, text, _ in chunk], return_offsets_mapping=True)
        for (i, _, spans), ids, offsets in zip(
            chunk, encoded["input_ids"], encoded["offset_mapping"], strict=True
        ):
            ids = np.array(ids, dtype=np.int32)
            flat = itertools.chain.from_iterable(offsets)
            offsets = np.fromiter(flat, dtype=np.int64, count=2 * len(ids)).reshape(-1, 2)
            try:
                mask = assistant_mask(ids, offsets, spans, special, records[i].origin)
            except DataError as exc:
                out[i] = exc
                continue
            out[i] = Tokens(ids, mask)
    return out


def generated_tokens(tokenizer, records: list[ChatRecord]) -> list[Tokens | DataError | None]:
    """Per record, the `Tokens` of its recorded token ids (module doc), or None where it has
    none or this tokenizer did not make them (the text is tokenized instead)."""
    out: list[Tokens | DataError | None] = [None] * len(records)
    todo = []  # (index, the prompt's rendering)
    for i, record in enumerate(records):
        if record.token_ids is not None:
            try:
                todo.append((i, _render(tokenizer, record.messages[:-1], record.origin, True)))
            except DataError as exc:
                out[i] = exc
    vocab, foreign = len(tokenizer), []
    for start in range(0, len(todo), BATCH):
        chunk = todo[start : start + BATCH]
        encoded = _encode(tokenizer, [text for _, text in chunk])["input_ids"]
        for (i, _), prompt in zip(chunk, encoded, strict=True):
            ids = records[i].token_ids
            if tuple(prompt) != ids.prompt or max(ids.answer) >= vocab:
                foreign.append(records[i].origin)
                continue
            n = len(ids.prompt)
            mask = np.zeros(n + len(ids.answer), dtype=bool)
            mask[n:] = True
            out[i] = Tokens(np.array(ids.prompt + ids.answer, dtype=np.int32), mask)
    if foreign:
        logger.warning(
            "%d of %d records carry token ids this tokenizer does not make (e.g. %s: its "
            "prompt encodes otherwise, or an id is outside its %d tokens); their text is "
            "tokenized instead",
            len(foreign),
            len(todo),
            foreign[0],
            vocab,
        )
    return out


def special_token_ids(tokenizer) -> set[int]:
    """Named special tokens plus every added token flagged special (e.g. `<|eot_id|>`)."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    return ids


def render_with_spans(tokenizer, record: ChatRecord) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) characters of each assistant turn."""
    messages = record.messages
    full = _render(tokenizer, messages, record.origin)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise DataError(
                f"{record.origin}: the conversation starts with an assistant message; chat "
                "templates cannot render the empty conversation before it, so its header "
                "cannot be located. Start with a user or system message."
            )
        head = _render(tokenizer, messages[:i], record.origin, add_generation_prompt=True)
        turn = _render(tokenizer, messages[: i + 1], record.origin)
        if not (turn.startswith(head) and full.startswith(turn)):
            raise DataError(
                f"{record.origin}: the chat template is not prefix-stable at messages[{i}]: "
                "the rendering up to this assistant message is not a prefix of the rendering "
                "of the whole conversation (the template rewrites earlier turns depending on "
                "later ones), so its tokens cannot be located safely; use a template that "
                "renders each turn independently, or skip such records with skip_malformed"
            )
        spans.append((len(head), len(turn)))
    return full, spans


def assistant_mask(
    ids: np.ndarray,
    offsets: np.ndarray,
    spans: list[tuple[int, int]],
    special_ids: np.ndarray,
    origin: str,
) -> np.ndarray:
    """Loss mask [L] from token character offsets [L, 2] and assistant spans (see module doc)."""
    mask = np.zeros(len(ids), dtype=bool)
    starts, ends = offsets[:, 0], offsets[:, 1]
    if np.any(np.diff(starts) < 0):
        raise DataError(f"{origin}: the tokenizer's offsets are not monotonic; cannot mask")
    for a, b in spans:
        # [lo, hi): the tokens starting inside the turn, one straddling its end included ...
        lo, hi = np.searchsorted(starts, [a, b], side="left")
        # ... and the one straddling its start.
        while lo > 0 and ends[lo - 1] > a:
            lo -= 1
        last_special = np.flatnonzero(np.isin(ids[lo:hi], special_ids))
        stop = lo + last_special[-1] + 1 if last_special.size else hi
        mask[lo:stop] = True
    return mask


def _render(tokenizer, messages, origin: str, add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:
        raise DataError(
            f"{origin}: the chat template failed on messages[:{len(messages)}] "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def _encode(tokenizer, texts: list[str], **kwargs) -> dict:
    return tokenizer(
        texts, add_special_tokens=False, return_attention_mask=False, verbose=False, **kwargs
    )
