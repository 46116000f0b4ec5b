"""An OpenAI request as the router's requests: one `GenerateInput` per prompt, asking for
its n completions (the router prefills the prompt once for them: core/choices.py), built
straight from the pydantic body (no protobuf on this path: the router's validator takes
the same typed input from both fronts).

    completions: prompt (text | ids | a batch of either) × n  ->  choices, prompt-major:
                 choice i = prompt i // n, completion i % n (seed + i % n when a seed is given)
    chat:        messages (and tools) -> the model's chat template -> token ids (engine.chat,
                 the same function as engine.LLM.chat), × n; tool_choice "auto" and the
                 reasoning parser (output_parsers.py) go to the reply
    both:        response_format / structured_outputs / forcing tools -> structured_outputs
                 (structured.py), the same spec for every choice

Everything the engine cannot honour is refused here, naming the field (400).
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field, replace

from pdserve.engine import InvalidRequestError, SamplingParams
from pdserve.engine.chat import TemplateOptions, encode_chat_prompt
from pdserve.services.router.core.model_info import ModelInfo
from pdserve.services.router.core.request import GenerateInput
from pdserve.services.router.fronts.http.errors import bad_request, from_invalid, model_not_found
from pdserve.services.router.fronts.http.fields import refuse_unsupported
from pdserve.services.router.fronts.http.output_parsers import AutoTools, OutputParsers
from pdserve.services.router.fronts.http.parsing.reasoning import ReasoningParser
from pdserve.services.router.fronts.http.schemas import ChatCompletionRequest, CompletionRequest, _GenerateRequest
from pdserve.services.router.fronts.http.structured import Guide, ToolChoice, guide

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is the rest of the context
MAX_LOGPROBS = 20           # the engine's limit
_INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class Job:
    """What one HTTP request asks of the router."""
    req_id: str
    inputs: tuple[GenerateInput, ...]                  # one per prompt, each with sampling.n completions
    prompt_of: tuple[int, ...]                         # each choice's prompt (usage counts a prompt once)
    stream: bool
    include_usage: bool
    logprobs: int | None                               # top-N to report; None: no logprobs
    rename: dict[str, str] = field(default_factory=dict)  # the router's field names -> this API's
    tool_choice: ToolChoice | None = None              # chat: the output is tool calls (tool_calls.py)
    auto_tools: AutoTools | None = None                # chat: tool calls read from the output, if any
    reasoning: ReasoningParser | None = None           # chat: <think>...</think> to reasoning_content
    echo: Echo | None = None                           # completions: the prompt before the output
    prompt_logprobs: bool = False                      # the engine computes them: the reply carries them
    reply_id: str = ""                                 # vLLM's request_id: the response's id (else req_id)
    tokens_as_ids: bool = False                        # return_tokens_as_token_ids: "token_id:N" in logprobs
    include_reasoning: bool = True                     # chat: false drops reasoning_content
    return_token_ids: bool = False                     # vLLM's: prompt_token_ids and each choice's token_ids
    chat_echo: str = ""                                # chat echo: the last (assistant) message, before the reply
    continuous_usage: bool = False                     # vLLM's continuous_usage_stats: usage so far in every chunk


@dataclass(frozen=True)
class Echo:
    """Completions' echo: each prompt's text before its choices' (with logprobs, its tokens'
    logprobs before theirs: the first token's null). `only` (max_tokens 0): the prompt and
    nothing else; one token is generated and dropped, as vLLM does."""
    texts: tuple[str | None, ...]  # per prompt; None: its token ids (truncated ones too), decoded
    only: bool


def completion_job(body: CompletionRequest, model: ModelInfo, slo_header: str | None, max_choices: int) -> Job:
    _check_common(body, model)
    refuse_unsupported(body, "completions")
    n = body.n if body.n is not None else 1
    if body.best_of is not None and body.best_of != n:
        raise bad_request("best_of", f"must equal n ({n}) when set: runs are not ranked")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise bad_request("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {body.logprobs}")
    prompts = _prompts(body.prompt)
    max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETION_MAX_TOKENS
    echo = None
    if body.echo:
        # a truncated prompt is echoed as what the model saw: its kept tokens, decoded
        texts = tuple(p if isinstance(p, str) and body.truncate_prompt_tokens is None else None for p in prompts)
        echo = Echo(texts, only=max_tokens == 0)
        max_tokens = max(max_tokens, 1)
    prompt_logprobs = _prompt_logprobs(body, body.logprobs if body.echo else None)
    guided = guide(body)
    sampling = _sampling(body, max_tokens, body.logprobs, guided, prompt_logprobs)
    job = _job(body, prompts, sampling, slo_header, max_choices, body.logprobs,
               {"prompt_token_ids": "prompt", **guided.rename})
    return replace(job, echo=echo)


def chat_job(body: ChatCompletionRequest, model: ModelInfo, tokenizer, slo_header: str | None,
             max_choices: int, max_messages: int, parsers: OutputParsers = OutputParsers()) -> Job:
    _check_common(body, model)
    refuse_unsupported(body, "chat")
    guided = guide(body)
    auto_tools = parsers.auto_tools(body)
    top = _chat_top_logprobs(body)
    token_ids = chat_prompt(body, tokenizer, max_messages)
    max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:  # as OpenAI: up to the end of the context
        max_tokens = max(1, model.max_model_len - len(token_ids))
    rename = {"prompt": "messages", "prompt_token_ids": "messages", "logprobs": "top_logprobs",
              "max_tokens": max_name, **guided.rename}
    sampling = _sampling(body, max_tokens, top, guided, _prompt_logprobs(body, None))
    if auto_tools is not None and auto_tools.parser.keeps_special_tokens and body.skip_special_tokens is None:
        sampling["skip_special_tokens"] = False  # the parser's markers are special tokens (vLLM's mistral)
    job = _job(body, [token_ids], sampling, slo_header, max_choices, top, rename, guided.tool_choice)
    last = body.messages[-1]
    # vLLM's chat echo: the last message's content before the reply's, when it is the reply's role
    echo = _text(last.content, len(body.messages) - 1) if body.echo and last.role == "assistant" else ""
    # a guided output is constrained from its first token: there is no thinking in it to parse
    reasoning = parsers.reasoning if guided.params is None else None
    return replace(job, auto_tools=auto_tools, reasoning=reasoning,
                   include_reasoning=body.include_reasoning is not False, chat_echo=echo)


def chat_prompt(body: ChatCompletionRequest, tokenizer, max_messages: int) -> list[int]:
    """Refused before the template runs: too many messages, a role the API does not know, and
    (engine.chat) control-token text in a content that cannot be kept plain text. The tools
    are rendered whatever tool_choice says (as vLLM does)."""
    options = template_options(body)
    if not body.messages:
        raise bad_request("messages", "must hold at least one message")
    if len(body.messages) > max_messages:
        raise bad_request("messages", f"at most {max_messages} messages, got {len(body.messages)}")
    conversation = [_message(m, i) for i, m in enumerate(body.messages)]
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    try:
        return encode_chat_prompt(tokenizer, conversation, tools, options)[1]
    except InvalidRequestError as e:
        raise from_invalid(e, {}) from None


def template_options(body) -> TemplateOptions:
    """The template's inputs a chat (or /tokenize) request sets, as vLLM reads them:
    reasoning_effort is a template variable, and sets enable_thinking (false for "none")
    unless chat_template_kwargs does."""
    variables = dict(body.chat_template_kwargs or {})
    effort = getattr(body, "reasoning_effort", None)
    if effort is not None:
        variables["reasoning_effort"] = effort
        variables.setdefault("enable_thinking", effort != "none")
    try:
        return TemplateOptions(add_generation_prompt=body.add_generation_prompt is not False,
                               continue_final_message=bool(body.continue_final_message),
                               documents=getattr(body, "documents", None) or None, variables=variables)
    except InvalidRequestError as e:
        raise from_invalid(e, {}) from None


def _message(m, index: int) -> dict:
    """A message as chat templates take it: earlier tool calls and tool results included."""
    message = {"role": m.role, "content": _text(m.content, index)}
    if m.tool_calls:
        if m.role != "assistant":
            raise bad_request(f"messages[{index}].tool_calls", "only an assistant message makes tool calls")
        message["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
    for name in ("tool_call_id", "name"):
        if getattr(m, name) is not None:
            message[name] = getattr(m, name)
    return message


def _text(content, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"messages[{index}].content", f"only text parts are supported, got {part.type!r}")
        parts.append(part.text)
    return "".join(parts)


def _chat_top_logprobs(body: ChatCompletionRequest) -> int | None:
    if not body.logprobs:
        if body.top_logprobs:
            raise bad_request("top_logprobs", "needs logprobs: true")
        return None
    top = body.top_logprobs or 0
    if not 0 <= top <= MAX_LOGPROBS:
        raise bad_request("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {top}")
    return top


def _check_common(body: _GenerateRequest, model: ModelInfo) -> None:
    if body.model is not None and not model.serves(body.model):
        raise model_not_found(body.model, model.served_name)
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options", "is only allowed with stream: true")


def _prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise bad_request("prompt", "is empty")
    return list(prompt)


def _prompt_logprobs(body: _GenerateRequest, echoed: int | None) -> int | None:
    """What the engine computes: prompt_logprobs as asked, else an echoed prompt's logprobs
    (completions' `logprobs`). As vLLM: N > 0 is refused with a stream (no chunk carries
    them); 0 streamed would reach nobody, so nothing is computed for it."""
    asked = body.prompt_logprobs
    if asked is not None:
        if not 0 <= asked <= MAX_LOGPROBS:
            raise bad_request("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {asked}")
        if body.stream and asked > 0:
            raise bad_request("prompt_logprobs", "is not available with stream: true")
        if body.stream:
            asked = None
    return echoed if asked is None else asked


def _sampling(body: _GenerateRequest, max_tokens: int, logprobs: int | None, guided: Guide,
              prompt_logprobs: int | None = None) -> dict:
    """The sampling fields that are set (unset ones take SamplingParams' defaults, the engine's)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    values = dict(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                  min_p=body.min_p, seed=body.seed, logprobs=logprobs, structured_outputs=guided.params,
                  prompt_logprobs=prompt_logprobs, include_stop_str_in_output=body.include_stop_str_in_output,
                  skip_special_tokens=body.skip_special_tokens,
                  repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                  frequency_penalty=body.frequency_penalty, min_tokens=body.min_tokens,
                  allowed_token_ids=body.allowed_token_ids, logit_bias=_logit_bias(body.logit_bias))
    return dict({k: v for k, v in values.items() if v is not None}, stop=stop,
                stop_token_ids=list(body.stop_token_ids or []), ignore_eos=bool(body.ignore_eos),
                bad_words=list(body.bad_words or []))


def _logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """JSON keys are strings: each must spell a token id (OpenAI's and vLLM's form)."""
    if logit_bias is None:
        return None
    biases = {}
    for key, bias in logit_bias.items():
        if not re.fullmatch(r"\s*-?[0-9]{1,12}\s*", key):
            raise bad_request("logit_bias", f"keys must be token ids, got {key[:20]!r}")
        biases[int(key)] = bias
    return biases


def _job(body: _GenerateRequest, prompts: list, sampling: dict, slo_header: str | None, max_choices: int,
         logprobs: int | None, rename: dict[str, str], tool_choice: ToolChoice | None = None) -> Job:
    n = body.n if body.n is not None else 1
    if n < 1:
        raise bad_request("n", f"must be >= 1, got {n}")
    if n * len(prompts) > max_choices:
        raise bad_request("n" if len(prompts) == 1 else "prompt",
                          f"{n * len(prompts)} choices asked for; at most {max_choices} per request")
    # completion i gets seed + i (the router's rule), and the workers' wire carries seeds as int64
    if body.seed is not None and not 0 <= body.seed <= _INT64_MAX - n:
        raise bad_request("seed", f"must be in [0, 2^63 - n), got {body.seed}")
    req_id = uuid.uuid4().hex
    num_choices = n * len(prompts)
    slo_class = body.slo_class or slo_header or ""
    params = _params(dict(sampling, n=n), rename)  # n completions of each prompt, its prefill shared
    inputs = []
    for i, prompt in enumerate(prompts):
        run_id = req_id if len(prompts) == 1 else f"{req_id}-{i}"
        inputs.append(GenerateInput(prompt if isinstance(prompt, str) else tuple(prompt), params, run_id,
                                    slo_class, body.model or "", body.cache_salt or "", body.truncate_prompt_tokens))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    # as vLLM: continuous_usage_stats only counts beside include_usage
    continuous_usage = include_usage and bool(body.stream_options.continuous_usage_stats)
    return Job(req_id, tuple(inputs), tuple(i // n for i in range(num_choices)), bool(body.stream),
               include_usage, logprobs, rename, tool_choice, prompt_logprobs="prompt_logprobs" in sampling,
               reply_id=body.request_id or "", tokens_as_ids=bool(body.return_tokens_as_token_ids),
               return_token_ids=bool(body.return_token_ids), continuous_usage=continuous_usage)


def _params(sampling: dict, rename: dict[str, str]) -> SamplingParams:
    try:
        return SamplingParams(**sampling)
    except InvalidRequestError as e:  # the engine's own checks, under this API's field names
        raise from_invalid(e, rename) from None
