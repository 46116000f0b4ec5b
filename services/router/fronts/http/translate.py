"""An OpenAI request as the router's requests: one `GenerateInput` per choice, built
straight from the pydantic body (no protobuf on this path: the router's validator takes
the same typed input from both fronts).

    completions: prompt (text | ids | a batch of either) × n  ->  choices, prompt-major:
                 choice i = prompt i // n, run i % n (seed + i % n when a seed is given)
    chat:        messages -> the model's chat template -> token ids (engine.chat, the same
                 function as engine.LLM.chat), × n
    both:        response_format / structured_outputs / forcing tools -> structured_outputs
                 (structured.py), the same spec for every choice

Everything the engine cannot honour is refused here, naming the field (400).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from engine import InvalidRequestError, SamplingParams
from engine.chat import encode_chat_prompt
from services.router.core.model_info import ModelInfo
from services.router.core.request import GenerateInput
from services.router.fronts.http.errors import bad_request, from_invalid, model_not_found
from services.router.fronts.http.schemas import ChatCompletionRequest, CompletionRequest, _GenerateRequest
from services.router.fronts.http.structured import Guide, ToolChoice, guide

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is the rest of the context
MAX_LOGPROBS = 20           # the engine's limit
_INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class Job:
    """What one HTTP request asks of the router."""
    req_id: str
    inputs: tuple[GenerateInput, ...]                  # one per choice, in choice order
    prompt_of: tuple[int, ...]                         # each choice's prompt (usage counts a prompt once)
    stream: bool
    include_usage: bool
    logprobs: int | None                               # top-N to report; None: no logprobs
    rename: dict[str, str] = field(default_factory=dict)  # the router's field names -> this API's
    tool_choice: ToolChoice | None = None              # chat: the output is tool calls (tool_calls.py)


def completion_job(body: CompletionRequest, model: ModelInfo, slo_header: str | None, max_choices: int) -> Job:
    _check_common(body, model)
    if body.echo:
        raise bad_request("echo", "is not supported")
    if body.suffix:
        raise bad_request("suffix", "is not supported")
    n = body.n if body.n is not None else 1
    if body.best_of is not None and body.best_of != n:
        raise bad_request("best_of", f"must equal n ({n}) when set: runs are not ranked")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise bad_request("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {body.logprobs}")
    prompts = _prompts(body.prompt)
    max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETION_MAX_TOKENS
    guided = guide(body)
    sampling = _sampling(body, max_tokens, body.logprobs, guided)
    return _job(body, prompts, sampling, slo_header, max_choices, body.logprobs,
                {"prompt_token_ids": "prompt", **guided.rename})


def chat_job(body: ChatCompletionRequest, model: ModelInfo, tokenizer, slo_header: str | None,
             max_choices: int, max_messages: int) -> Job:
    _check_common(body, model)
    guided = guide(body)
    top = _chat_top_logprobs(body)
    token_ids = chat_prompt(body, tokenizer, max_messages)
    max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:  # as OpenAI: up to the end of the context
        max_tokens = max(1, model.max_model_len - len(token_ids))
    rename = {"prompt": "messages", "prompt_token_ids": "messages", "logprobs": "top_logprobs",
              "max_tokens": max_name, **guided.rename}
    return _job(body, [token_ids], _sampling(body, max_tokens, top, guided), slo_header, max_choices, top, rename,
                guided.tool_choice)


def chat_prompt(body: ChatCompletionRequest, tokenizer, max_messages: int) -> list[int]:
    """Refused before the template runs: too many messages, a role the API does not know, and
    (engine.chat) control-token text in a content that cannot be kept plain text."""
    if not body.messages:
        raise bad_request("messages", "must hold at least one message")
    if len(body.messages) > max_messages:
        raise bad_request("messages", f"at most {max_messages} messages, got {len(body.messages)}")
    conversation = [{"role": m.role, "content": _text(m.content, i)} for i, m in enumerate(body.messages)]
    try:
        return encode_chat_prompt(tokenizer, conversation)[1]
    except InvalidRequestError as e:
        raise from_invalid(e, {}) from None


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
    if not model.serves(body.model):
        raise model_not_found(body.model, model.served_name)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):  # 0 and unset are neutral
            raise bad_request(name, "is not supported by this engine (only 0)")
    if body.logit_bias:
        raise bad_request("logit_bias", "is not supported")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options", "is only allowed with stream: true")


def _prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise bad_request("prompt", "is empty")
    return list(prompt)


def _sampling(body: _GenerateRequest, max_tokens: int, logprobs: int | None, guided: Guide) -> dict:
    """The sampling fields that are set (unset ones take SamplingParams' defaults, the engine's)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    values = dict(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                  min_p=body.min_p, seed=body.seed, logprobs=logprobs, structured_outputs=guided.params)
    return dict({k: v for k, v in values.items() if v is not None}, stop=stop,
                stop_token_ids=list(body.stop_token_ids or []), ignore_eos=bool(body.ignore_eos))


def _job(body: _GenerateRequest, prompts: list, sampling: dict, slo_header: str | None, max_choices: int,
         logprobs: int | None, rename: dict[str, str], tool_choice: ToolChoice | None = None) -> Job:
    n = body.n if body.n is not None else 1
    if n < 1:
        raise bad_request("n", f"must be >= 1, got {n}")
    if n * len(prompts) > max_choices:
        raise bad_request("n" if len(prompts) == 1 else "prompt",
                          f"{n * len(prompts)} choices asked for; at most {max_choices} per request")
    # run i gets seed + i, and the workers' wire carries seeds as int64
    if body.seed is not None and not 0 <= body.seed <= _INT64_MAX - n:
        raise bad_request("seed", f"must be in [0, 2^63 - n), got {body.seed}")
    req_id = uuid.uuid4().hex
    num_choices = n * len(prompts)
    slo_class = body.slo_class or slo_header or ""
    inputs = []
    for i in range(num_choices):
        run_sampling = dict(sampling, seed=sampling["seed"] + i % n) if "seed" in sampling else sampling
        run_id = req_id if num_choices == 1 else f"{req_id}-{i}"
        prompt = prompts[i // n]
        inputs.append(GenerateInput(prompt if isinstance(prompt, str) else tuple(prompt),
                                    _params(run_sampling, rename), run_id, slo_class, body.model,
                                    body.cache_salt or ""))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Job(req_id, tuple(inputs), tuple(i // n for i in range(num_choices)), bool(body.stream),
               include_usage, logprobs, rename, tool_choice)


def _params(sampling: dict, rename: dict[str, str]) -> SamplingParams:
    try:
        return SamplingParams(**sampling)
    except InvalidRequestError as e:  # the engine's own checks, under this API's field names
        raise from_invalid(e, rename) from None
