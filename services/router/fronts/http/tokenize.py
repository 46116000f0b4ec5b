"""vLLM's tokenizer endpoints, with the router's own tokenizer (no worker is asked):

    POST /tokenize    {"model"?, "prompt", "add_special_tokens"?: true}
                      {"model"?, "messages", "tools"?, "add_generation_prompt"?: true, "continue_final_message"?,
                       "chat_template_kwargs"?, "add_special_tokens"?: false}
                      -> {"count", "max_model_len", "tokens", "token_strs"?}
    POST /detokenize  {"model"?, "tokens"} -> {"prompt"}

A prompt's tokens are those /v1/completions sends for it; messages' are those
/v1/chat/completions sends (the same chat_prompt: template, its options, tools, control-token
text kept plain), the generation prompt included unless asked otherwise. `model`, when given, must be
a served name (404 otherwise, as the other endpoints). Every refusal is a 400 naming its field.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt

from pdserve.services.router.core.model_info import ModelInfo
from pdserve.services.router.fronts.http.errors import bad_request, model_not_found
from pdserve.services.router.fronts.http.schemas import ChatMessage, Text, Tool
from pdserve.services.router.fronts.http.translate import chat_prompt


class TokenizeRequest(BaseModel):
    """vLLM's two request forms in one: exactly one of `prompt` and `messages`."""
    model_config = ConfigDict(extra="allow")
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # None: vLLM's default, true for a prompt, false for messages
    return_token_strs: bool = False
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Text | None = None
    tokens: list[StrictInt]


def tokenize(body: TokenizeRequest, model: ModelInfo, tokenizer, max_messages: int) -> dict:
    _check_model(body.model, model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("prompt" if body.prompt is not None else "messages",
                          "give either prompt (a text) or messages (a chat), not both" if body.prompt is not None
                          else "a body needs prompt (a text) or messages (a chat)")
    ids = _prompt_ids(body, tokenizer) if body.prompt is not None else _chat_ids(body, tokenizer, max_messages)
    out = {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = list(tokenizer.convert_ids_to_tokens(ids))
    return out


def detokenize(body: DetokenizeRequest, model: ModelInfo, tokenizer) -> dict:
    _check_model(body.model, model)
    vocab = model.vocab_size
    if (bad := next((t for t in body.tokens if not 0 <= t < vocab), None)) is not None:
        raise bad_request("tokens", f"every id must be an integer in [0, {vocab}) (the vocabulary), got {bad}")
    return {"prompt": tokenizer.decode(body.tokens)}


def _check_model(name: str | None, model: ModelInfo) -> None:
    if name is not None and not model.serves(name):
        raise model_not_found(name, model.served_name)


def _prompt_ids(body: TokenizeRequest, tokenizer) -> list[int]:
    add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
    return list(tokenizer.encode(body.prompt, add_special_tokens=add_special_tokens)) if body.prompt else []


def _chat_ids(body: TokenizeRequest, tokenizer, max_messages: int) -> list[int]:
    if body.chat_template is not None:
        raise bad_request("chat_template", "is not supported: the router's --chat-template (or the model's) applies")
    ids = chat_prompt(body, tokenizer, max_messages)
    if not body.add_special_tokens:
        return ids
    before, after = _special_wrapping(tokenizer)
    return before + ids + after


def _special_wrapping(tokenizer) -> tuple[list[int], list[int]]:
    """What add_special_tokens puts before and after one sequence (Llama: BOS before; most
    chat tokenizers: nothing), read off the tokenizer by encoding one character both ways."""
    bare = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start], full[start + len(bare):]
    return [], []
