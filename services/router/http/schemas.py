"""The request bodies of POST /v1/completions and /v1/chat/completions (pydantic).

Unknown fields are ignored, as OpenAI clients and agent frameworks send many; the fields
pdserve cannot honour are listed here and refused by translate.py when they are set to
anything but their neutral value. Extensions (vLLM's names): top_k, min_p, ignore_eos,
stop_token_ids, and slo_class (also the `x-pdserve-slo` header).

Every string is `Text`: JSON may carry half of a UTF-16 pair ("\\ud800") that Python keeps
as a lone surrogate, which no tokenizer, protobuf or response encoder accepts; it is
refused here, as a 400 naming the field.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict

from services.router.request import has_lone_surrogate


def _whole_text(value: str) -> str:
    if has_lone_surrogate(value):
        raise ValueError("holds a lone UTF-16 surrogate (e.g. \\ud800), which is not text")
    return value


Text = Annotated[str, AfterValidator(_whole_text)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = None


class _GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Text
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: Text | None = None  # accepted; the router has no use for it
    # not in the engine: refused unless neutral
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # extensions
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    slo_class: Text | None = None
    cache_salt: Text | None = None  # vLLM's: shares cached KV only with requests of the same salt


class CompletionRequest(_GenerateRequest):
    # a text, token ids, or a batch of either: one choice per prompt (times n)
    prompt: Text | list[int] | list[Text] | list[list[int]]
    logprobs: int | None = None  # top-N per token, legacy format
    echo: bool | None = None
    best_of: int | None = None
    suffix: Text | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Text
    text: Text | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]  # any other: 400 naming messages[i].role
    content: Text | list[ContentPart] | None = None


class ChatCompletionRequest(_GenerateRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins when both are set
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None
