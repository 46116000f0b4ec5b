"""docs/openai.md's "Every field" table, read here and walked against a running router, so
the document and the code cannot drift apart:

    the table     names every field the request models know, once per API, and vLLM's whole
                  list (VLLM_FIELDS); its refused and ignored rows are fields.py's
    honoured      a non-neutral value succeeds and does what it should: the offline engine's
                  output with the same setting, unlike the neutral request's (or the expected
                  transform of it: a prefix, the prompt before it, ...)
    refused       a 400 naming the field; each neutral value the table gives is accepted
    ignored       a 200 whose output is the neutral request's; the router logs the name once
    unknown       a field no row names passes the same way
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.chat import encode_chat_prompt
from pdserve.services.router.fronts.http.fields import IGNORED, REFUSED, REFUSED_STREAM_OPTIONS
from pdserve.services.router.fronts.http.schemas import ChatCompletionRequest, CompletionRequest, StreamOptions
from tests.services.router.fronts.http.support import raw_request, start_router

DOC = Path(__file__).resolve().parents[5] / "docs" / "openai.md"
MODELS = {"chat": ChatCompletionRequest, "completions": CompletionRequest}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 8
EOS = 2  # the tiny Llama's (SmolLM2's tokenizer): <|im_end|>
IM_START = 1  # a special token that ends nothing
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": WEATHER}}]
FIELDS_LOGGER = "pdserve.services.router.fronts.http.fields"

# vLLM's fields (vllm/entrypoints/openai/protocol.py at ec3b890c): the table must hold them all
_VLLM_BOTH = {
    "model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty", "seed", "stop",
    "stream", "stream_options.include_usage", "stream_options.continuous_usage_stats", "temperature", "top_p",
    "user", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
    "add_special_tokens", "response_format", "structured_outputs", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs", "echo"}
VLLM_FIELDS = {
    "chat": _VLLM_BOTH | {"messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                          "reasoning_effort", "include_reasoning", "parallel_tool_calls", "bad_words",
                          "add_generation_prompt", "continue_final_message", "documents", "chat_template",
                          "chat_template_kwargs", "mm_processor_kwargs"},
    "completions": _VLLM_BOTH | {"prompt", "suffix", "prompt_embeds"},
}


@dataclass(frozen=True)
class Row:
    field: str
    api: str
    status: str
    notes: str


def _table() -> list[Row]:
    section = DOC.read_text().split("\n## Every field\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        m = re.fullmatch(r"\| `([\w.]+)` \| (chat|completions|both) \| (honoured|refused|ignored) \| (.*?) ?\|", line)
        if m:
            field, api, status, notes = m.groups()
            rows += [Row(field, a, status, notes) for a in (("chat", "completions") if api == "both" else (api,))]
        else:
            assert not line.startswith("| `"), f"a row of the table does not parse: {line}"
    return rows


ROWS = _table()


def _fields_of(api: str) -> set[str]:
    fields = {f.alias or name for name, f in MODELS[api].model_fields.items()} - {"stream_options"}
    return fields | {f"stream_options.{name}" for name in StreamOptions.model_fields}


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_the_table_names_every_field_once(api):
    named = [r.field for r in ROWS if r.api == api]
    assert len(named) == len(set(named)), "a field has two rows"
    assert set(named) == _fields_of(api)
    assert VLLM_FIELDS[api] <= set(named)


def test_the_table_is_the_code_s_policy():
    for r in ROWS:
        refused = (REFUSED_STREAM_OPTIONS if r.field.startswith("stream_options.") else REFUSED[r.api])
        name = r.field.removeprefix("stream_options.")
        elsewhere = r.field in ("best_of", "functions")  # refused by translate.py, structured.py
        assert (name in refused or elsewhere) == (r.status == "refused"), r
        assert (r.field in IGNORED) == (r.status == "ignored"), r


# ---- the walk -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def walk_router(shared_cluster, tiny, tiny_llama_dir):
    router = start_router(shared_cluster, tiny_llama_dir, tiny.tokenizer)
    yield router
    router.stop(grace_s=0)


class Walk:
    """Requests that differ from the neutral one (greedy, MAX_TOKENS) in the fields given."""

    def __init__(self, router, llm, tokenizer, model: str, api: str):
        self.router, self.llm, self.tokenizer, self.model, self.api = router, llm, tokenizer, model, api
        self.prompt_ids = (encode_chat_prompt(tokenizer, MESSAGES)[1] if api == "chat"
                           else tokenizer.encode(PROMPT))
        self._neutral = None

    def body(self, **fields) -> dict:
        base = {"messages": MESSAGES} if self.api == "chat" else {"prompt": PROMPT}
        return {**base, "model": self.model, "max_tokens": MAX_TOKENS, "temperature": 0, **fields}

    def post(self, **fields) -> tuple[int, dict]:
        status, _, data = raw_request(self.router, "POST", PATHS[self.api], self.body(**fields))
        return status, json.loads(data)

    def ok(self, **fields) -> dict:
        status, r = self.post(**fields)
        assert status == 200, r
        return r

    def stream(self, **fields) -> list[dict]:
        status, _, data = raw_request(self.router, "POST", PATHS[self.api], self.body(stream=True, **fields))
        assert status == 200, data
        events = [e[len(b"data: "):] for e in data.split(b"\n\n") if e.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        return [json.loads(e) for e in events[:-1]]

    def text(self, r: dict, i: int = 0) -> str:
        choice = r["choices"][i]
        return choice["message"]["content"] if self.api == "chat" else choice["text"]

    def outcome(self, r: dict) -> tuple:
        return self.text(r), r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]

    def offline(self, prompt_ids: list[int] | None = None, **sampling):
        params = SamplingParams(**dict(dict(temperature=0, max_tokens=MAX_TOKENS), **sampling))
        return self.llm.generate({"prompt_token_ids": self.prompt_ids if prompt_ids is None else prompt_ids},
                                 params)[0]

    def hf_chat_ids(self, messages: list[dict], **template) -> list[int]:
        """transformers' own rendering of a chat, tokenized."""
        return list(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                       **dict(dict(add_generation_prompt=True), **template)))

    @property
    def neutral(self) -> dict:
        if self._neutral is None:
            self._neutral = self.ok()
        return self._neutral

    def neutral_tokens(self) -> list[int]:
        return self.offline().token_ids


def _as_offline(fields: dict, sampling: dict | None = None, differs: bool = True):
    """The reply is the offline engine's with the same setting (`sampling`: its name there),
    and it is not the neutral reply."""
    def probe(w: Walk):
        r = w.ok(**fields)
        want = w.offline(**(fields if sampling is None else sampling))
        assert w.outcome(r) == (want.text, want.finish_reason, len(want.token_ids))
        if differs:
            assert w.outcome(r) != w.outcome(w.neutral)
    return probe


def _greedy_when(**narrowing):
    """Sampling at temperature 2 narrowed to the top token is greedy; unnarrowed it is not."""
    def probe(w: Walk):
        hot = dict(temperature=2.0, seed=3)
        assert w.text(w.ok(**hot, **narrowing)) == w.text(w.neutral)
        assert w.text(w.ok(**hot)) != w.text(w.neutral)
    return probe


def _same_text(**fields):
    def probe(w: Walk):
        assert w.text(w.ok(**fields)) == w.text(w.neutral)
    return probe


def _stop(w: Walk, include: bool = False):
    stop = w.text(w.neutral)[4:8]
    _as_offline({"stop": [stop], "include_stop_str_in_output": include})(w)
    assert w.text(w.ok(stop=[stop], include_stop_str_in_output=include)).endswith(stop) == include


def _stop_token(w: Walk):
    _as_offline({"stop_token_ids": [w.neutral_tokens()[2]]})(w)


def _bad_word(w: Walk):
    """The first word of the neutral output that bad_words can block (as vLLM tokenizes a bad
    word, one may miss the same word inside a text)."""
    neutral = w.offline().token_ids
    words = [w.tokenizer.decode([t]).strip() for t in neutral]
    word = next(x for x in words if x and w.offline(bad_words=[x]).token_ids != neutral)
    _as_offline({"bad_words": [word]})(w)


def _logit_bias(w: Walk, **more):
    return _as_offline({"logit_bias": {str(EOS): 100}, **more}, {"logit_bias": {EOS: 100}, **more})(w)


def _n(w: Walk):
    r = w.ok(n=2)
    assert [w.text(r, i) for i in range(2)] == [w.text(w.neutral)] * 2


def _seed(w: Walk):
    hot = dict(temperature=2.0, seed=5)
    first, second = w.ok(**hot), w.ok(**hot)
    assert w.text(first) == w.text(second) == w.offline(**hot).text != w.text(w.neutral)


def _model(w: Walk):
    assert w.text(w.ok(model=w.model)) == w.text(w.neutral)
    status, _, data = raw_request(w.router, "POST", PATHS[w.api], {k: v for k, v in w.body().items() if k != "model"})
    assert status == 200 and w.text(json.loads(data)) == w.text(w.neutral)  # unset: the served model


def _other_input(w: Walk):
    other = {"messages": [{"role": "user", "content": "Write about mountains."}]} if w.api == "chat" \
        else {"prompt": "Mountains are"}
    assert w.text(w.ok(**other)) != w.text(w.neutral)


def _max_tokens(name: str):
    def probe(w: Walk):
        r = w.ok(**{name: 3})
        assert r["usage"]["completion_tokens"] == 3 and w.text(w.neutral).startswith(w.text(r))
        assert w.text(r) == w.offline(max_tokens=3).text
    return probe


def _logprobs(w: Walk):
    r = w.ok(logprobs=True if w.api == "chat" else 2)
    lp = r["choices"][0]["logprobs"]
    assert len(lp["content"] if w.api == "chat" else lp["tokens"]) == r["usage"]["completion_tokens"]
    assert w.text(r) == w.text(w.neutral)


def _top_logprobs(w: Walk):
    content = w.ok(logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    assert content and all(len(c["top_logprobs"]) == 2 for c in content)


def _prompt_logprobs(w: Walk):
    r = w.ok(prompt_logprobs=1)
    got = r["prompt_logprobs"] if w.api == "chat" else r["choices"][0]["prompt_logprobs"]
    assert len(got) == r["usage"]["prompt_tokens"] == len(w.prompt_ids) and got[0] is None
    assert w.text(r) == w.text(w.neutral)


def _echo(w: Walk):
    if w.api == "completions":
        assert w.text(w.ok(echo=True)) == PROMPT + w.text(w.neutral)
        return
    assert w.text(w.ok(echo=True)) == w.text(w.neutral)  # the last message is the user's: nothing to echo
    started = MESSAGES + [{"role": "assistant", "content": "The capital"}]
    fields = dict(messages=started, add_generation_prompt=False, continue_final_message=True)
    go_on = w.text(w.ok(**fields))
    assert w.text(w.ok(echo=True, **fields)) == "The capital" + go_on
    chunks = w.stream(echo=True, **fields)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[1]["choices"][0]["delta"] == {"content": "The capital"}  # the echo: after the role, before the rest


def _truncate_prompt_tokens(w: Walk):
    r = w.ok(truncate_prompt_tokens=3)
    want = w.offline(w.prompt_ids[-3:])
    assert (w.text(r), r["usage"]["prompt_tokens"]) == (want.text, 3) and w.text(r) != w.text(w.neutral)
    assert w.text(w.ok(truncate_prompt_tokens=-1)) == w.text(w.neutral)  # the whole context: nothing cut
    status, body = w.post(truncate_prompt_tokens=0)
    assert status == 400 and body["error"]["param"] == "truncate_prompt_tokens"


def _return_token_ids(w: Walk):
    r = w.ok(return_token_ids=True)
    choice = r["choices"][0]
    prompt_ids = r["prompt_token_ids"] if w.api == "chat" else choice["prompt_token_ids"]
    assert prompt_ids == w.prompt_ids and choice["token_ids"] == w.neutral_tokens()
    assert w.text(r) == w.text(w.neutral) and "token_ids" not in w.neutral["choices"][0]
    chunks = w.stream(return_token_ids=True)
    first = chunks[0] if w.api == "chat" else chunks[0]["choices"][0]
    assert first["prompt_token_ids"] == w.prompt_ids
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == w.neutral_tokens()


def _template_option(**template):
    """The prompt sent (return_token_ids) is transformers' rendering with the same option, not
    the neutral one, and the reply the offline engine's on it (the random tiny model may well
    answer both prompts alike)."""
    messages = MESSAGES + ([{"role": "assistant", "content": "The capital"}]
                           if template.get("continue_final_message") else [])

    def probe(w: Walk):
        fields = dict(template, add_generation_prompt=False) if "continue_final_message" in template else template
        r = w.ok(messages=messages, return_token_ids=True, **fields)
        ids = w.hf_chat_ids(messages, **fields)
        assert r["prompt_token_ids"] == ids != w.prompt_ids  # the option changed what the model sees
        assert w.text(r) == w.offline(ids).text
    return probe


def _template_variables(**variables):
    """Variables reach the template as transformers passes them (SmolLM2's reads none, so the
    prompt is the neutral one: tests/engine/test_chat.py shows one that reads them)."""
    def probe(w: Walk):
        r = w.ok(return_token_ids=True, **variables)
        kwargs = dict(variables.get("chat_template_kwargs", {}))
        if "documents" in variables:
            kwargs["documents"] = variables["documents"]
        if "reasoning_effort" in variables:
            kwargs.update(reasoning_effort=variables["reasoning_effort"], enable_thinking=True)
        assert r["prompt_token_ids"] == w.hf_chat_ids(MESSAGES, **kwargs)
        status, body = w.post(chat_template_kwargs={"tokenize": True})
        assert status == 400 and body["error"]["param"] == "chat_template_kwargs.tokenize"
    return probe


def _stream(w: Walk):
    chunks = w.stream()
    pieces = [c["choices"][0]["delta"].get("content") or "" if w.api == "chat" else c["choices"][0]["text"]
              for c in chunks if c["choices"]]
    assert "".join(pieces) == w.text(w.neutral)


def _include_usage(w: Walk):
    last = w.stream(stream_options={"include_usage": True})[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == w.neutral["usage"]["completion_tokens"]


def _continuous_usage(w: Walk):
    chunks = w.stream(stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    prompt = w.neutral["usage"]["prompt_tokens"]
    assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks)
    assert counts == sorted(counts) and counts[-1] == w.neutral["usage"]["completion_tokens"]
    assert len(set(counts)) > 2  # it grew chunk by chunk, not only at the end
    # without include_usage it asks for nothing (as vLLM): no usage anywhere
    assert all("usage" not in c for c in w.stream(stream_options={"continuous_usage_stats": True}))


def _json_object(w: Walk):
    r = w.ok(response_format={"type": "json_object"})
    assert w.text(r).lstrip().startswith("{") and w.text(r) != w.text(w.neutral)


def _choice(w: Walk):
    assert w.text(w.ok(structured_outputs={"choice": ["yes", "no"]})) in ("yes", "no")


def _tool_calls(w: Walk, **fields) -> list[dict]:
    r = w.ok(tools=TOOLS, **dict(dict(max_tokens=160), **fields))
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    return r["choices"][0]["message"]["tool_calls"]


def _tools(w: Walk):
    assert _tool_calls(w, tool_choice="required")


def _tool_choice(w: Walk):
    named = {"type": "function", "function": {"name": "get_time"}}
    assert [c["function"]["name"] for c in _tool_calls(w, tool_choice=named)] == ["get_time"]


def _parallel_tool_calls(w: Walk):
    assert len(_tool_calls(w, tool_choice="required", parallel_tool_calls=False)) == 1


def _include_reasoning(w: Walk):
    r = w.ok(include_reasoning=False)
    assert w.text(r) == w.text(w.neutral) and "reasoning_content" not in r["choices"][0]["message"]


def _request_id(w: Walk):
    assert w.ok(request_id="walk-7")["id"] == ("chatcmpl" if w.api == "chat" else "cmpl") + "-walk-7"


def _tokens_as_ids(w: Walk):
    lp = w.ok(logprobs=True if w.api == "chat" else 1, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    tokens = [c["token"] for c in lp["content"]] if w.api == "chat" else lp["tokens"]
    assert tokens and all(re.fullmatch(r"token_id:\d+", t) for t in tokens)


HONOURED = {
    "messages": _other_input, "prompt": _other_input, "model": _model,
    "max_tokens": _max_tokens("max_tokens"), "max_completion_tokens": _max_tokens("max_completion_tokens"),
    "n": _n, "temperature": _as_offline({"temperature": 2.0, "seed": 3}), "seed": _seed,
    "top_p": _greedy_when(top_p=1e-6), "top_k": _greedy_when(top_k=1), "min_p": _greedy_when(min_p=1.0),
    "stop": _stop, "include_stop_str_in_output": lambda w: _stop(w, include=True), "stop_token_ids": _stop_token,
    "ignore_eos": lambda w: _logit_bias(w, ignore_eos=True), "min_tokens": lambda w: _logit_bias(w, min_tokens=3),
    "presence_penalty": _as_offline({"presence_penalty": 2.0}),
    "frequency_penalty": _as_offline({"frequency_penalty": 2.0}),
    "repetition_penalty": _as_offline({"repetition_penalty": 1.5}),
    "logit_bias": _as_offline({"logit_bias": {"300": 100}}, {"logit_bias": {300: 100}}),
    "bad_words": _bad_word, "allowed_token_ids": _as_offline({"allowed_token_ids": [300, 301, 302]}),
    "logprobs": _logprobs, "top_logprobs": _top_logprobs, "prompt_logprobs": _prompt_logprobs, "echo": _echo,
    "stream": _stream, "stream_options.include_usage": _include_usage,
    "stream_options.continuous_usage_stats": _continuous_usage,
    "response_format": _json_object, "structured_outputs": _choice,
    "tools": _tools, "tool_choice": _tool_choice, "parallel_tool_calls": _parallel_tool_calls,
    "skip_special_tokens": _as_offline({"logit_bias": {str(IM_START): 100}, "skip_special_tokens": False},
                                       {"logit_bias": {IM_START: 100}, "skip_special_tokens": False}),
    "include_reasoning": _include_reasoning, "request_id": _request_id,
    "return_tokens_as_token_ids": _tokens_as_ids,
    "cache_salt": _same_text(cache_salt="walk-salt"), "slo_class": _same_text(slo_class="batch"),
    "truncate_prompt_tokens": _truncate_prompt_tokens, "return_token_ids": _return_token_ids,
    "add_generation_prompt": _template_option(add_generation_prompt=False),
    "continue_final_message": _template_option(continue_final_message=True),
    "documents": _template_variables(documents=[{"title": "Paris", "text": "Paris is the capital of France."}]),
    "chat_template_kwargs": _template_variables(chat_template_kwargs={"enable_thinking": False}),
    "reasoning_effort": _template_variables(reasoning_effort="low"),
}
REFUSED_VALUES = {  # a value each refused field is refused with
    "best_of": 2, "suffix": " the end.", "prompt_embeds": "AAAA", "priority": 1,
    "logits_processors": ["my_module.MyProcessor"], "kv_transfer_params": {"do_remote_prefill": True},
    "vllm_xargs": {"x": 1}, "chat_template": "{{ messages }}", "functions": [{"name": "f", "parameters": {}}],
}
IGNORED_VALUES = {"user": "walker", "length_penalty": 2.0, "mm_processor_kwargs": {"num_crops": 4},
                  "service_tier": "auto", "store": False, "metadata": {"walk": "yes"}}


def _case_id(r: Row) -> str:
    return f"{r.api}-{r.field}"


def _set(field: str, value) -> dict:
    """The body fields that set `field` (a stream_options one needs a stream)."""
    if field.startswith("stream_options."):
        return {"stream": True, "stream_options": {field.removeprefix("stream_options."): value}}
    return {field: value}


@pytest.mark.parametrize("row", [r for r in ROWS if r.status == "honoured"], ids=_case_id)
def test_honoured(walk_router, cluster, llm, tokenizer, model, row):
    HONOURED[row.field](Walk(walk_router, llm, tokenizer, model, row.api))


_OMIT = object()


def _neutral_values(row: Row) -> list:
    """The values the table's notes call neutral: "unset or []" -> [omitted, []]; n is 1 here."""
    words = row.notes.split(" (")[0].split(" or ")
    return [{"unset": _OMIT, "n": 1}[w] if w in ("unset", "n") else json.loads(w) for w in words]


@pytest.mark.parametrize("row", [r for r in ROWS if r.status == "refused"], ids=_case_id)
def test_refused(walk_router, cluster, llm, tokenizer, model, row):
    w = Walk(walk_router, llm, tokenizer, model, row.api)
    # the rest are booleans: the other one than the table's neutral value
    value = REFUSED_VALUES[row.field] if row.field in REFUSED_VALUES else not _neutral_values(row)[0]
    status, _, data = raw_request(w.router, "POST", PATHS[w.api], w.body(**_set(row.field, value)))
    error = json.loads(data)["error"]
    assert status == 400 and error["param"] == row.field and row.field in error["message"]
    for neutral in _neutral_values(row):  # what the table calls neutral is accepted
        if neutral is _OMIT:
            continue
        if row.field.startswith("stream_options."):
            assert w.stream(stream_options={row.field.removeprefix("stream_options."): neutral})
        else:
            assert w.text(w.ok(**{row.field: neutral})) == w.text(w.neutral)


@pytest.mark.parametrize("row", [r for r in ROWS if r.status == "ignored"], ids=_case_id)
def test_ignored(shared_cluster, cluster, llm, tokenizer, tiny, tiny_llama_dir, model, row, caplog):
    _passes_and_is_logged_once(shared_cluster, llm, tokenizer, tiny, tiny_llama_dir, model, row.api,
                               {row.field: IGNORED_VALUES[row.field]}, row.field, caplog)


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_unknown_fields_pass_and_are_logged_once(shared_cluster, cluster, llm, tokenizer, tiny, tiny_llama_dir,
                                                 model, api, caplog):
    _passes_and_is_logged_once(shared_cluster, llm, tokenizer, tiny, tiny_llama_dir, model, api,
                               {"frobnicate": {"level": 3}}, "frobnicate", caplog)


def _passes_and_is_logged_once(shared_cluster, llm, tokenizer, tiny, tiny_llama_dir, model, api, fields, name,
                               caplog):
    router = start_router(shared_cluster, tiny_llama_dir, tiny.tokenizer)  # its own log-once memory
    try:
        w = Walk(router, llm, tokenizer, model, api)
        with caplog.at_level(logging.WARNING, logger=FIELDS_LOGGER):
            neutral = w.text(w.neutral)
            assert [w.text(w.ok(**fields)) for _ in range(2)] == [neutral] * 2
        logged = [r for r in caplog.records if r.name == FIELDS_LOGGER and repr(name) in r.getMessage()]
        assert len(logged) == 1
    finally:
        router.stop(grace_s=0)
