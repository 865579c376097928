import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdistill.data.records import ChatRecord, DataError, TextRecord
from specdistill.data.tokenize import Tokens, tokenize_records
from tests.data.conftest import make_tokenizer

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


def test_token_crossing_a_turn_edge_is_rejected():
    # "assistant: " + "there" tokenises with "Ġthe" spanning the header's space.
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tokenizer = make_tokenizer(chat_template=template)
    (error,) = tokenize_records(tokenizer, [chat(("user", "q"), ("assistant", "there"))])
    assert isinstance(error, DataError)
    assert "a token crosses the edge of an assistant turn" in str(error)


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
    if isinstance(tokens, DataError):
        # Only a merge across the header's newline and the content can make this happen.
        assert "crosses the edge" in str(tokens)
        assert any(c[:1].isspace() for c in assistant)
        return
    rendered = _TOKENIZER.apply_chat_template(
        [dict(role=r, content=c) for r, c in turns], tokenize=False
    )
    assert _TOKENIZER.decode(tokens.ids) == rendered
    # Adjacent assistant turns are separated by their headers, so runs never merge.
    assert masked_runs(_TOKENIZER, tokens) == [c + END for c in assistant]
    assert int(np.sum(tokens.mask)) <= len(tokens.ids)
