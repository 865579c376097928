"""Response bodies: OpenAI's shapes for completions, chat completions (whole and streamed
chunks), the model list and errors, plus this server's `metrics.speculative_decoding`
(vLLM's per-request statistics) and `draft_version`.

Bodies are written with `body(model)`. A field named in a model's `OPTIONAL` is written only
when it was set, so a chunk carries `usage` only when the client asked for it and `metrics` /
`draft_version` only on its last chunk, as OpenAI's and vLLM's servers do.
"""

from typing import ClassVar, Literal

from fastapi.responses import Response
from pydantic import BaseModel, model_serializer

from specdistill.formats.traffic import SpeculativeRecord


class _Body(BaseModel):
    OPTIONAL: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        data = handler(self)
        for key in self.OPTIONAL:
            if key not in self.model_fields_set:
                data.pop(key, None)
        return data


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int  # the HTTP status


class ErrorBody(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "specdistill"
    draft_version: str | None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpecMetrics(BaseModel):
    speculative_decoding: SpeculativeRecord | None


class Message(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Delta(_Body):
    """A chat chunk's new text; `role` only on the first chunk."""

    OPTIONAL = ("role",)
    role: Literal["assistant"] | None = None
    content: str


class Choice(_Body):
    """A choice of a completion (`text`), a chat completion (`message`) or a streamed chunk of
    either (`text` / `delta`); exactly one of them is set."""

    OPTIONAL = ("text", "message", "delta")
    index: int = 0
    finish_reason: str | None
    logprobs: dict | None  # the completions or the chat shape (serve/app.py `logprobs_json`)
    text: str | None = None
    message: Message | None = None
    delta: Delta | None = None


class Completion(_Body):
    """A whole response (`text_completion`, `chat.completion`) or a streamed chunk
    (`text_completion`, `chat.completion.chunk`)."""

    OPTIONAL = ("usage", "metrics", "draft_version")
    id: str
    object: Literal["text_completion", "chat.completion", "chat.completion.chunk"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None
    metrics: SpecMetrics | None = None
    draft_version: str | None = None


def body(model: BaseModel, status: int = 200, headers: dict | None = None) -> Response:
    """A JSON response of `model`."""
    return Response(model.model_dump_json(), status, headers=headers, media_type="application/json")
