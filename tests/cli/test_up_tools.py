"""Tool calling through `pdserve up` on real models, driven by the official openai client as
an agent drives it (tool_choice "auto", its default, then the tool's result sent back): the
tools and the tool conversation reach the model as transformers renders them, token for
token (the prompt's length, and a greedy answer equal to the offline engine's on exactly
those tokens), and a model's text that holds no call comes back as plain content.

    tiny random Llama, whose own chat template renders tools     (the model's template)
    SmolLM2 (the embedded default), whose template does not      (--chat-template)

A random or small model never writes a hermes call by itself: the parsing of real calls is
tests/services/router/fronts/http/test_agent_tools.py's, with a scripted worker."""
from __future__ import annotations

from pathlib import Path

import openai
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.chat import load_chat_template, with_chat_template
from tests.cli.up_platform import running_up, up_ports
from tests.models import build_tiny_llama

TEMPLATE = str(Path(__file__).parents[2] / "examples" / "tool_chat_template_hermes.jinja")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 4
UP_ARGS = ["--prefill", "0", "--decode", "1", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]


def _turn_two(arguments) -> list[dict]:
    """The conversation after the model called the tool (`arguments`: JSON text as OpenAI sends
    it, or the object as HF templates take it) and the tool answered."""
    call = {"id": "call_0123456789abcdef01234567", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}
    return ASK + [{"role": "assistant", "content": "", "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": call["id"], "content": "18 C and sunny"}]


def _check_agent_conversation(http_port: int, model: str, llm: LLM, tokenizer) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0, timeout=120)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for sent, hf_form in ((ASK, ASK), (_turn_two('{"city": "Paris"}'), _turn_two({"city": "Paris"}))):
        expected_ids = list(tokenizer.apply_chat_template(hf_form, tools=TOOLS, add_generation_prompt=True,
                                                          return_dict=False))
        offline = llm.chat(sent, greedy, tools=TOOLS)[0]
        assert offline.prompt_token_ids == expected_ids
        kwargs = dict(model=model, messages=sent, tools=TOOLS, temperature=0, max_tokens=MAX_TOKENS,
                      extra_body={"ignore_eos": True})
        reply = client.chat.completions.create(**kwargs)
        choice = reply.choices[0]
        assert reply.usage.prompt_tokens == len(expected_ids)
        assert choice.message.content == offline.text and not choice.message.tool_calls  # no call: plain text
        assert choice.finish_reason == "length"
        chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == offline.text
        assert chunks[-1].choices[0].finish_reason == "length"
        assert not any(c.choices[0].delta.tool_calls for c in chunks)
    with pytest.raises(openai.BadRequestError) as e:  # the tool conversation is still checked
        client.chat.completions.create(model=model, messages=_turn_two('{"city": '), tools=TOOLS, max_tokens=1)
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama whose own chat template renders tools."""
    from transformers import AutoTokenizer
    path = build_tiny_llama(tmp_path_factory.mktemp("tiny-tools"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = load_chat_template(TEMPLATE)
    tokenizer.save_pretrained(path)
    return path


def test_a_model_whose_template_renders_tools(tool_model_dir, tmp_path):
    llm = LLM(tool_model_dir, progress=False, kv_cache_memory_bytes=8 << 20)
    with running_up(tool_model_dir, up_ports(1, http=True), UP_ARGS, tmp_path) as up:
        _check_agent_conversation(up.ports["http"], tool_model_dir, llm, llm.tokenizer)
    assert "does not render tools" not in "".join(up.lines)


def test_smollm2_with_a_tool_template_given_to_up(smollm2_loaded, tmp_path):
    llm = LLM("smollm2", progress=False, loaded_model=smollm2_loaded, kv_cache_memory_bytes=16 << 20,
              chat_template=TEMPLATE)
    tokenizer = with_chat_template(llm.tokenizer, load_chat_template(TEMPLATE))
    with running_up("smollm2", up_ports(1, http=True), UP_ARGS + ["--chat-template", TEMPLATE], tmp_path) as up:
        _check_agent_conversation(up.ports["http"], "smollm2", llm, tokenizer)
        log = "".join(up.lines)
    assert "does not render tools" not in log, log
