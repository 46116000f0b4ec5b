"""The request bodies of POST /v1/completions and /v1/chat/completions (pydantic).

Every field of vLLM's ChatCompletionRequest and CompletionRequest is typed here; fields.py
says which are refused unless neutral (by translate.py) and which are ignored. Unknown
fields pass, as OpenAI clients and agent frameworks send many, and are logged once by name. Extensions (vLLM's names): top_k, min_p, ignore_eos,
stop_token_ids, repetition_penalty, min_tokens, bad_words, allowed_token_ids, slo_class (also
the `x-pdserve-slo` header) and structured_outputs (guided decoding: what OpenAI's
response_format and tools have no field for).

Every string is `Text`: JSON may carry half of a UTF-16 pair ("\\ud800") that Python keeps
as a lone surrogate, which no tokenizer, protobuf or response encoder accepts; it is
refused here, as a 400 naming the field.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from pdserve.services.router.core.request import has_lone_surrogate


def _whole_text(value: str) -> str:
    if has_lone_surrogate(value):
        raise ValueError("holds a lone UTF-16 surrogate (e.g. \\ud800), which is not text")
    return value


Text = Annotated[str, AfterValidator(_whole_text)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage so far in every chunk (replies.py)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: Text | None = None  # OpenAI requires one; it names the schema, nothing more
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's extra body: exactly one of these. An unknown key is refused (a client asking
    for a constraint this server would silently not apply is better told)."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")  # a schema, or its JSON text
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None  # EBNF (xgrammar's dialect; llama.cpp's GBNF)
    json_object: bool | None = None
    # an option, not a spec: JSON without whitespace between tokens (also with response_format or tools)
    disable_any_whitespace: bool | None = None


class _GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Text | None = None  # unset: the served model (vLLM's)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: Text | None = None  # accepted; the router has no use for it
    # on the logits before temperature (engine/sample/logits_processors.py)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token ids as strings of ints (JSON keys) -> bias
    # extensions
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    bad_words: list[Text] | None = None
    allowed_token_ids: list[int] | None = None
    slo_class: Text | None = None
    cache_salt: Text | None = None  # vLLM's: shares cached KV only with requests of the same salt
    # guided decoding (at most one of the two; see structured.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # the rest of vLLM's fields (its protocol.py), each honoured, refused unless neutral or
    # ignored: see fields.py and docs/openai.md ("Every field")
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    request_id: Text | None = None  # names the response (its id), not the request on the workers
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None
    priority: int | None = None
    logits_processors: list[Text | dict[str, Any]] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    # OpenAI's, beside vLLM's: none changes an output
    service_tier: Text | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None


class CompletionRequest(_GenerateRequest):
    # a text, token ids, or a batch of either: one choice per prompt (times n)
    prompt: Text | list[int] | list[Text] | list[list[int]]
    logprobs: int | None = None  # top-N per token, legacy format
    echo: bool | None = None  # the prompt before each choice's text (and its tokens' logprobs)
    best_of: int | None = None
    suffix: Text | None = None
    prompt_embeds: Text | list[Text] | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Text
    text: Text | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Text
    arguments: Text | dict[str, Any] | None = None  # OpenAI sends JSON text; the template gets the object


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made (the reply's tool_calls, sent back)."""
    model_config = ConfigDict(extra="allow")
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]  # any other: 400 naming messages[i].role
    content: Text | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant: the calls it made
    tool_call_id: Text | None = None                 # tool: the call this is the result of
    name: Text | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: any JSON object
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Text


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_GenerateRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins when both are set
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    include_reasoning: bool | None = None  # false: no reasoning_content (the thinking is still cut out)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None  # vLLM's
    echo: bool | None = None  # the last message's content before the reply, when it is an assistant's
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
