import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specdistill.data.records import ChatRecord, DataError, TextRecord, TokenIds
from specdistill.data.tokenize import Tokens, tokenize_records
from tests.data.helpers import EOS, make_tokenizer
from tests.helpers import make_tokenizer as make_train_tokenizer

END = "<|im_end|>"


def masked_runs(tokenizer, tokens: Tokens) -> list[str]:
    """The decoded text of each maximal run of loss tokens."""
    runs, current = [], []
    for token_id, on in zip(tokens.ids.tolist(), tokens.mask.tolist(), strict=True):
        if on:
            current.append(token_id)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def chat(*turns: tuple[str, str], origin: str = "chats.jsonl:1") -> ChatRecord:
    return ChatRecord([{"role": r, "content": c} for r, c in turns], origin)


CONVERSATION = chat(
    ("system", "be brief"),
    ("user", "hi there"),
    ("assistant", "hello 🙂 world"),
    ("user", "and?"),
    ("assistant", "def f(x):\n    return x + 1\n"),
)


def test_text_is_its_tokens_then_eos_all_targets(tiny_tokenizer):
    (tokens,) = tokenize_records(tiny_tokenizer, [TextRecord("def f(x): pass", "a.py")])
    expected = tiny_tokenizer("def f(x): pass", add_special_tokens=False)["input_ids"]
    assert tokens.ids.tolist() == [*expected, tiny_tokenizer.eos_token_id]
    assert tokens.mask.all()


def test_text_needs_eos():
    tokenizer = make_tokenizer()
    tokenizer.eos_token = None
    with pytest.raises(DataError, match="no eos_token"):
        tokenize_records(tokenizer, [TextRecord("x", "a.py")])


def test_chat_mask_is_exactly_the_assistant_turns(tiny_tokenizer):
    (tokens,) = tokenize_records(tiny_tokenizer, [CONVERSATION])
    rendered = tiny_tokenizer.apply_chat_template(CONVERSATION.messages, tokenize=False)
    assert tokens.ids.tolist() == tiny_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert masked_runs(tiny_tokenizer, tokens) == [
        "hello 🙂 world" + END,
        "def f(x):\n    return x + 1\n" + END,
    ]


def test_sharegpt_and_openai_give_the_same_tokens(tiny_tokenizer, tmp_path):
    from specdistill.data.records import record_from_row

    sharegpt = record_from_row(
        {
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "hi there"},
                {"from": "gpt", "value": "hello 🙂 world"},
            ]
        },
        "a",
    )
    openai = record_from_row({"messages": CONVERSATION.messages[:3]}, "b")
    a, b = tokenize_records(tiny_tokenizer, [sharegpt, openai])
    assert a.ids.tolist() == b.ids.tolist()
    assert a.mask.tolist() == b.mask.tolist()
    assert a.mask.any()


def test_chat_without_assistant_has_no_targets(tiny_tokenizer):
    (tokens,) = tokenize_records(tiny_tokenizer, [chat(("user", "hi"))])
    assert len(tokens.ids) > 0 and not tokens.mask.any()


def test_llama3_style_template():
    # Header tokens, a BOS written by the template, content trimmed, no separator after EOT.
    special = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    template = (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
        "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    )
    tokenizer = make_tokenizer(chat_template=template, special_tokens=special)
    tokenizer.bos_token = "<|begin_of_text|>"
    record = chat(
        ("user", "q"), ("assistant", "  the answer \n"), ("user", "r"), ("assistant", "x")
    )
    (tokens,) = tokenize_records(tokenizer, [record])
    assert tokens.ids[0] == tokenizer.bos_token_id
    assert masked_runs(tokenizer, tokens) == ["the answer<|eot_id|>", "x<|eot_id|>"]


# Replies that start or end with whitespace. Byte-level BPE merges the newline that ends an
# assistant header with the spaces, tabs or newlines that start the reply, so one token
# straddles the start of the turn; it is a training target.
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN = (  # Qwen2.5's template without tools: a default system prompt, ChatML turns
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role != 'system' or not loop.first %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Indentation after a blank line, so that the BPE learns "\n\n   ", "\n\t", "\n\n\n", ...
CODE = [
    "def f(x):\n    return x\n\n    return y\n\n\n\nclass A:\n  pass\n",
    "def g(y):\n\t\treturn y\n\n\t\treturn x\n",
]
LEADING = ["    return x", "  x", "\t\treturn x", "\treturn x", "\n\nreturn x", "\nx", " x"]
TRAILING = ["return x\n", "return x\n\n", "return x    ", "return x\t", "    return x\n\n\t"]


def code_tokenizer(chat_template: str, special_tokens: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on indented code, with every whitespace merge it needs."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS, *special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CODE * 10, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        additional_special_tokens=list(special_tokens),
        chat_template=chat_template,
    )


def chatml_tokenizer():
    return make_tokenizer()


def train_chatml_tokenizer():
    return make_train_tokenizer()


def llama3_tokenizer():
    tokenizer = code_tokenizer(LLAMA3, LLAMA3_SPECIAL)
    tokenizer.bos_token = "<|begin_of_text|>"
    return tokenizer


def qwen_tokenizer():
    return code_tokenizer(QWEN, ["<|im_start|>", "<|im_end|>"])


# (tokenizer, the assistant header, the end-of-turn token)
TEMPLATES = {
    "chatml": (chatml_tokenizer, "<|im_start|>assistant\n", END),
    "chatml-train": (train_chatml_tokenizer, "<|im_start|>assistant\n", END),
    "llama3": (llama3_tokenizer, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "qwen": (qwen_tokenizer, "<|im_start|>assistant\n", END),
}


def start_edge_is_crossed(tokenizer, record: ChatRecord, header: str) -> bool:
    """Whether a token of the rendering holds both the first reply's header and its content."""
    messages = record.messages
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    head = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert head.endswith(header)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return any(a < len(head) < b for a, b in offsets["offset_mapping"])


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("reply", LEADING + TRAILING)
def test_replies_with_edge_whitespace_train_whole(template, reply):
    make, header, end = TEMPLATES[template]
    tokenizer = make()
    record = chat(("user", "q"), ("assistant", reply), ("user", "again"), ("assistant", reply))
    (tokens,) = tokenize_records(tokenizer, [record])
    assert isinstance(tokens, Tokens), tokens
    rendered = tokenizer.apply_chat_template(record.messages, tokenize=False)
    assert tokens.ids.tolist() == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    runs = masked_runs(tokenizer, tokens)
    assert len(runs) == 2
    for run in runs:
        # The whole reply and its end-of-turn token, after at most the header's tail.
        assert run.endswith(reply + end)
        assert header.endswith(run.removesuffix(reply + end))
    end_id = tokenizer.convert_tokens_to_ids(end)
    last_masked = np.flatnonzero(tokens.mask & ~np.append(tokens.mask[1:], False))
    assert tokens.ids[last_masked].tolist() == [end_id, end_id]


@pytest.mark.parametrize("template", TEMPLATES)
def test_indented_reply_crosses_the_start_edge(template):
    # The case above that the old rule ("a crossing token is an error") refused, for every
    # template; with the code tokenizer also for tabs and blank lines.
    make, header, end = TEMPLATES[template]
    tokenizer = make()
    replies = ["    return x"]
    if template in ("llama3", "qwen"):
        replies += ["\t\treturn x", "\n\nreturn x"]
    for reply in replies:
        record = chat(("user", "q"), ("assistant", reply))
        assert start_edge_is_crossed(tokenizer, record, header), reply
        (tokens,) = tokenize_records(tokenizer, [record])
        (run,) = masked_runs(tokenizer, tokens)
        assert run.endswith(reply + end) and run != reply + end


def test_template_that_rewrites_earlier_turns_is_rejected():
    # The last message gets a marker, so a prefix renders differently from the whole.
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}{% if loop.last %} (last){% endif %}"
        "\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer = make_tokenizer(chat_template=template)
    (error,) = tokenize_records(tokenizer, [chat(("user", "q"), ("assistant", "a"))])
    assert isinstance(error, DataError)
    assert str(error).startswith(
        "chats.jsonl:1: the chat template is not prefix-stable at messages[1]"
    )


def test_token_crossing_the_start_of_a_turn_is_a_target():
    # "assistant: " + "there" tokenises with "Ġthe" spanning the header's space.
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tokenizer = make_tokenizer(chat_template=template)
    (tokens,) = tokenize_records(tokenizer, [chat(("user", "q"), ("assistant", "there"))])
    assert masked_runs(tokenizer, tokens) == [" there" + END]


def test_token_crossing_the_end_of_a_turn_is_a_target():
    # No end-of-turn token: the turn ends with the template's space, which "Ġthe" of the
    # next turn's header takes along, so that token holds an assistant character.
    template = (
        "{% for m in messages %}the {{ m['role'] }}:{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}the assistant:{% endif %}"
    )
    tokenizer = make_tokenizer(chat_template=template)
    record = chat(("user", "q"), ("assistant", "hello"), ("user", "r"))
    (tokens,) = tokenize_records(tokenizer, [record])
    rendered = tokenizer.apply_chat_template(record.messages, tokenize=False)
    assert rendered == "the user:q the assistant:hello the user:r "
    assert masked_runs(tokenizer, tokens) == ["hello the"]


def test_conversation_starting_with_the_assistant_is_rejected(tiny_tokenizer):
    (error,) = tokenize_records(tiny_tokenizer, [chat(("assistant", "hi"), ("user", "q"))])
    assert isinstance(error, DataError)
    assert str(error).startswith("chats.jsonl:1: the conversation starts with an assistant message")


def test_template_error_names_the_record():
    tokenizer = make_tokenizer(chat_template="{{ raise_exception('roles must alternate') }}")
    (error,) = tokenize_records(tokenizer, [chat(("user", "q"))])
    assert isinstance(error, DataError)
    assert str(error).startswith("chats.jsonl:1: the chat template failed")
    assert "roles must alternate" in str(error)


def test_chat_needs_a_chat_template():
    tokenizer = make_tokenizer(chat_template=None)
    with pytest.raises(DataError, match="chats.jsonl:1: chat records need a tokenizer with a chat"):
        tokenize_records(tokenizer, [chat(("user", "q"), ("assistant", "a"))])


def test_text_and_chat_records_keep_their_order(tiny_tokenizer):
    records = [TextRecord("a", "1"), chat(("user", "q"), ("assistant", "b")), TextRecord("c", "3")]
    out = tokenize_records(tiny_tokenizer, records)
    assert [tiny_tokenizer.decode(t.ids[t.mask]) for t in out] == [
        "a<|endoftext|>",
        "b<|im_end|>",
        "c<|endoftext|>",
    ]


_TOKENIZER = make_tokenizer()
_CONTENT = st.text(alphabet="abthe rq\n🙂é:(", max_size=12)
_TURN = st.tuples(st.sampled_from(["system", "user", "assistant"]), _CONTENT)


@settings(
    max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.lists(_TURN, min_size=1, max_size=6))
def test_masked_tokens_decode_to_assistant_contents(turns):
    (tokens,) = tokenize_records(_TOKENIZER, [chat(*turns)])
    assistant = [content for role, content in turns if role == "assistant"]
    if turns[0][0] == "assistant":
        assert "starts with an assistant message" in str(tokens)
        return
    rendered = _TOKENIZER.apply_chat_template(
        [dict(role=r, content=c) for r, c in turns], tokenize=False
    )
    assert _TOKENIZER.decode(tokens.ids) == rendered
    # Adjacent assistant turns are separated by their headers, so runs never merge. A reply
    # starting with whitespace may take the header's newline along (one token).
    runs = masked_runs(_TOKENIZER, tokens)
    assert len(runs) == len(assistant)
    for run, content in zip(runs, assistant, strict=True):
        merged = content[:1].isspace() and run == "\n" + content + END
        assert run == content + END or merged
    assert int(np.sum(tokens.mask)) <= len(tokens.ids)


def _generated(tokenizer, question: str, answer_ids: list[int], prompt_ids=None) -> ChatRecord:
    """A one-turn conversation carrying the ids it was generated as (data/records.py)."""
    messages = [{"role": "user", "content": question}]
    if prompt_ids is None:
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
    ids = TokenIds(tuple(prompt_ids), tuple(answer_ids))
    return ChatRecord([*messages, {"role": "assistant", "content": answer}], "gen:1", ids)


def _split_otherwise(tokenizer, text: str) -> list[int]:
    """`text`'s tokens with the longest one drawn as its characters: a split the tokenizer
    never makes but a sampler can draw."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    longest = max(range(len(ids)), key=lambda i: len(tokenizer.convert_ids_to_tokens(ids[i])))
    pieces = list(tokenizer.convert_ids_to_tokens(ids[longest]))
    assert len(pieces) > 1
    return ids[:longest] + tokenizer.convert_tokens_to_ids(pieces) + ids[longest + 1 :]


def test_generated_ids_are_trained_as_drawn(tiny_tokenizer):
    end = tiny_tokenizer.convert_tokens_to_ids(END)
    drawn = [*_split_otherwise(tiny_tokenizer, "def f(x): return x"), end]
    record = _generated(tiny_tokenizer, "hi there", drawn)
    (tokens,) = tokenize_records(tiny_tokenizer, [record])
    prompt = list(record.token_ids.prompt)
    assert tokens.ids.tolist() == prompt + drawn
    assert tokens.mask.tolist() == [False] * len(prompt) + [True] * len(drawn)
    (text,) = tokenize_records(tiny_tokenizer, [ChatRecord(record.messages, "gen:1")])
    assert text.ids[text.mask].tolist() != drawn  # the text re-tokenizes otherwise
    assert tokenizer_decode(tiny_tokenizer, text.ids[text.mask]) == tokenizer_decode(
        tiny_tokenizer, np.array(drawn)
    )


def tokenizer_decode(tokenizer, ids: np.ndarray) -> str:
    return tokenizer.decode(ids.tolist())


@pytest.mark.parametrize("problem", ["another prompt", "an id outside the vocabulary"])
def test_ids_this_tokenizer_did_not_make_fall_back_to_the_text(tiny_tokenizer, caplog, problem):
    drawn = tiny_tokenizer("return x", add_special_tokens=False)["input_ids"]
    record = _generated(tiny_tokenizer, "hi there", drawn)
    if problem == "another prompt":  # e.g. another tokenizer's or template's encoding
        record = _generated(tiny_tokenizer, "hi there", drawn, [1, *record.token_ids.prompt])
    else:
        record = _generated(tiny_tokenizer, "hi there", [*drawn, len(tiny_tokenizer)])
    (tokens,) = tokenize_records(tiny_tokenizer, [record])
    (text,) = tokenize_records(tiny_tokenizer, [ChatRecord(record.messages, "gen:1")])
    assert tokens.ids.tolist() == text.ids.tolist()
    assert tokens.mask.tolist() == text.mask.tolist()
    assert "1 of 1 records carry token ids this tokenizer does not make (e.g. gen:1" in caplog.text
