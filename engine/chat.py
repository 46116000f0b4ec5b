"""A conversation as a prompt: the model's chat template, applied the same way by the
offline `LLM.chat`, `pdserve generate --chat` and the router's /v1/chat/completions, so the
three send a model the same tokens for the same messages."""
from __future__ import annotations

from engine.errors import InvalidRequestError


def render_chat_prompt(tokenizer, conversation: list[dict]) -> str:
    """The prompt text for `conversation` ([{"role", "content"}, ...]) with the assistant's turn
    opened. Raises InvalidRequestError("messages", ...) when the model has no template, a
    message is malformed, or the template itself refuses the conversation."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("messages", "this model has no chat template")
    if not all(isinstance(m, dict) and "role" in m and "content" in m for m in conversation):
        raise InvalidRequestError("messages", "each message needs 'role' and 'content'")
    try:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the template's own checks (e.g. role order) raise from Jinja
        raise InvalidRequestError("messages", f"the chat template refused them: {e}") from None


def encode_chat_prompt(tokenizer, conversation: list[dict]) -> tuple[str, list[int]]:
    """The rendered prompt and its token ids. No special tokens are added: the template
    already wrote them (a second BOS would change the model's answer)."""
    text = render_chat_prompt(tokenizer, conversation)
    return text, list(tokenizer.encode(text, add_special_tokens=False))
