"""engine.chat: the one place a conversation becomes a prompt (LLM.chat, `pdserve generate
--chat` and the router's /v1/chat/completions all call it). Fake tokenizers: no model."""
from __future__ import annotations

import pytest

from engine.chat import encode_chat_prompt, render_chat_prompt
from engine.errors import InvalidRequestError

HI = [{"role": "user", "content": "Hi"}]


class _Tokenizer:
    chat_template = "{{ messages }}"

    def __init__(self, refuse: str | None = None):
        self.refuse = refuse
        self.encoded: list[tuple[str, bool]] = []

    def apply_chat_template(self, conversation, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        if self.refuse:
            raise RuntimeError(self.refuse)  # as a template's raise_exception does, from Jinja
        return "".join(f"<{m['role']}>{m['content']}" for m in conversation) + "<assistant>"

    def encode(self, text, add_special_tokens=True):
        self.encoded.append((text, add_special_tokens))
        return [ord(c) for c in text]


def test_renders_with_the_assistant_turn_open():
    assert render_chat_prompt(_Tokenizer(), HI) == "<user>Hi<assistant>"


def test_encoding_adds_no_special_tokens_the_template_already_wrote():
    tokenizer = _Tokenizer()
    text, ids = encode_chat_prompt(tokenizer, HI)
    assert text == "<user>Hi<assistant>" and ids == [ord(c) for c in text]
    assert tokenizer.encoded == [(text, False)]


@pytest.mark.parametrize("tokenizer,conversation,message", [
    (type("NoTemplate", (), {"chat_template": None})(), HI, "messages: this model has no chat template"),
    (_Tokenizer(), [{"content": "no role"}], "messages: each message needs 'role' and 'content'"),
    (_Tokenizer(), ["not a dict"], "messages: each message needs 'role' and 'content'"),
    (_Tokenizer(refuse="roles must alternate"), HI, "messages: the chat template refused them: roles must alternate"),
])
def test_refusals_name_the_messages(tokenizer, conversation, message):
    with pytest.raises(InvalidRequestError) as e:
        render_chat_prompt(tokenizer, conversation)
    assert e.value.field == "messages" and str(e.value) == message
