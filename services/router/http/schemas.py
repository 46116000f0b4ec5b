"""The request bodies of POST /v1/completions and /v1/chat/completions (pydantic).

Unknown fields are ignored, as OpenAI clients and agent frameworks send many; the fields
pdserve cannot honour are listed here and refused by translate.py when they are set to
anything but their neutral value. Extensions (vLLM's names): top_k, min_p, ignore_eos,
stop_token_ids, and slo_class (also the `x-pdserve-slo` header).
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = None


class _GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted; the router has no use for it
    # not in the engine: refused unless neutral
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # extensions
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    slo_class: str | None = None


class CompletionRequest(_GenerateRequest):
    # a text, token ids, or a batch of either: one choice per prompt (times n)
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # top-N per token, legacy format
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_GenerateRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins when both are set
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None
