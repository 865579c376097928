import re

import pytest

from specdistill.data.records import (
    ChatRecord,
    DataError,
    TextRecord,
    TokenIds,
    record_from_row,
)


def test_text_row():
    assert record_from_row({"text": "abc", "id": 3}, "f:1") == TextRecord("abc", "f:1")


def test_empty_text_is_no_record():
    assert record_from_row({"text": ""}, "f:1") is None


def test_openai_messages_keep_role_and_content_only():
    row = {
        "messages": [
            {"role": "system", "content": "s", "name": "x"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": ""},
        ]
    }
    assert record_from_row(row, "f:1") == ChatRecord(
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "ab"},
            {"role": "assistant", "content": ""},
        ],
        "f:1",
    )


def test_sharegpt_maps_roles():
    row = {
        "conversations": [
            {"from": "system", "value": "s"},
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "a"},
        ]
    }
    record = record_from_row(row, "f:1")
    assert [m["role"] for m in record.messages] == ["system", "user", "assistant"]
    assert [m["content"] for m in record.messages] == ["s", "q", "a"]


def test_null_field_counts_as_absent():
    # Tabular sources carry every column in every row.
    assert record_from_row({"text": "t", "messages": None}, "r") == TextRecord("t", "r")


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ([1, 2], "expected a JSON object, got list"),
        (
            {"body": "x"},
            "missing field: expected 'text', 'messages' or 'conversations' (keys: body)",
        ),
        ({"text": 5}, "'text' must be a string, got int"),
        ({"messages": "hi"}, "'messages' must be a list, got str"),
        ({"messages": []}, "'messages' is an empty list"),
        ({"messages": ["hi"]}, "messages[0] must be an object, got str"),
        ({"messages": [{"role": "user"}]}, "messages[0]: missing field 'content'"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]: unknown role 'tool'"),
        ({"messages": [{"role": "user", "content": []}]}, "'content' is an empty list"),
        ({"messages": [{"role": "user", "content": 3}]}, "'content' must be a string or a list"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "content[0] is not a text part (type 'image_url')",
        ),
        ({"conversations": []}, "'conversations' is an empty list"),
        ({"conversations": [{"from": "bot", "value": "x"}]}, "unknown role 'bot' in 'from'"),
        ({"conversations": [{"from": "gpt"}]}, "conversations[0]: missing field 'value'"),
        ({"conversations": [{"from": "gpt", "value": 1}]}, "'value' must be a string, got int"),
    ],
)
def test_malformed_rows_name_origin_and_problem(row, problem):
    with pytest.raises(DataError) as info:
        record_from_row(row, "chats.jsonl:7")
    message = str(info.value)
    assert message.startswith("chats.jsonl:7: ")
    assert problem in message


@pytest.mark.parametrize(
    "row",
    [
        {"text": "def \udfff f(x): return x"},
        {"messages": [{"role": "user", "content": "write \ud800 code"}]},
        {"conversations": [{"from": "human", "value": "x \udbff"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
    ],
)
def test_a_lone_surrogate_is_not_text(row):
    """Every reader of records (distill, regenerate, cache) refuses it, counted as not UTF-8."""
    with pytest.raises(DataError, match=r"^f\.jsonl:3: not UTF-8 text") as info:
        record_from_row(row, "f.jsonl:3")
    assert info.value.reason == "not UTF-8"
    paired = {"text": "a pair \U0001f600 is text"}  # what json.loads makes of a valid pair
    assert record_from_row(paired, "f.jsonl:4") == TextRecord(paired["text"], "f.jsonl:4")


def test_token_ids_ride_with_the_answer_they_encode():
    row = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        "token_ids": {"prompt": [5, 6], "answer": [7, 0]},
    }
    record = record_from_row(row, "f:1")
    assert record.token_ids == TokenIds((5, 6), (7, 0))


@pytest.mark.parametrize(
    ("token_ids", "problem"),
    [
        ([1, 2], "must be an object with 'prompt' and 'answer'"),
        ({"prompt": [1]}, "must be an object with 'prompt' and 'answer'"),
        ({"prompt": [], "answer": [1]}, "'prompt'] must be a list of 1 to"),
        ({"prompt": [1], "answer": [-1]}, "'answer'] must be a list of 1 to"),
        ({"prompt": [1], "answer": [2**31]}, "'answer'] must be a list of 1 to"),
        ({"prompt": [1.0], "answer": [1]}, "'prompt'] must be a list of 1 to"),
        ({"prompt": [True], "answer": [1]}, "'prompt'] must be a list of 1 to"),
        ({"prompt": "12", "answer": [1]}, "'prompt'] must be a list of 1 to"),
    ],
)
def test_malformed_token_ids_are_refused_by_name(token_ids, problem):
    row = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        "token_ids": token_ids,
    }
    with pytest.raises(DataError, match=re.escape(problem)) as raised:
        record_from_row(row, "f:3")
    assert str(raised.value).startswith("f:3: 'token_ids'")
    assert raised.value.reason == "bad token ids"


def test_token_ids_need_the_answer_last():
    row = {
        "messages": [{"role": "user", "content": "q"}],
        "token_ids": {"prompt": [1], "answer": [2]},
    }
    with pytest.raises(DataError, match="must end with the answer the ids encode"):
        record_from_row(row, "f:1")
