"""An OpenAI request as the router's requests: one `GenerateRequest` per choice.

    completions: prompt (text | ids | a batch of either) × n  ->  choices, prompt-major:
                 choice i = prompt i // n, run i % n (seed + i % n when a seed is given)
    chat:        messages -> the model's chat template -> token ids (no special tokens
                 added: the template has them), exactly as engine.LLM.chat, × n

Everything the engine cannot honour is refused here, naming the field (400).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from services.pb import common_pb2, router_pb2
from services.router.http.errors import bad_request, model_not_found
from services.router.http.schemas import ChatCompletionRequest, CompletionRequest, _GenerateRequest
from services.router.model_info import ModelInfo

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is the rest of the context
MAX_LOGPROBS = 20           # the engine's limit
_INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class Job:
    """What one HTTP request asks of the router."""
    request_id: str
    requests: tuple[router_pb2.GenerateRequest, ...]  # one per choice, in choice order
    prompt_of: tuple[int, ...]                         # each choice's prompt (usage counts a prompt once)
    stream: bool
    include_usage: bool
    logprobs: int | None                               # top-N to report; None: no logprobs
    rename: dict[str, str] = field(default_factory=dict)  # the router's field names -> this API's


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
    sampling = _sampling(body, max_tokens, body.logprobs)
    return _job(body, prompts, sampling, slo_header, max_choices, body.logprobs, {"prompt_token_ids": "prompt"})


def chat_job(body: ChatCompletionRequest, model: ModelInfo, tokenizer, slo_header: str | None,
             max_choices: int) -> Job:
    _check_common(body, model)
    if body.tools or body.functions:
        raise bad_request("tools" if body.tools else "functions", "tool calling is not supported")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise bad_request("response_format", "only {\"type\": \"text\"} is supported")
    top = _chat_top_logprobs(body)
    token_ids = chat_prompt(body, tokenizer)
    max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:  # as OpenAI: up to the end of the context
        max_tokens = max(1, model.max_model_len - len(token_ids))
    rename = {"prompt": "messages", "prompt_token_ids": "messages", "logprobs": "top_logprobs",
              "max_tokens": max_name}
    return _job(body, [token_ids], _sampling(body, max_tokens, top), slo_header, max_choices, top, rename)


def chat_prompt(body: ChatCompletionRequest, tokenizer) -> list[int]:
    if not body.messages:
        raise bad_request("messages", "must hold at least one message")
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("messages", "this model has no chat template")
    conversation = [{"role": m.role, "content": _text(m.content, i)} for i, m in enumerate(body.messages)]
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the template's own checks (e.g. role order) raise from Jinja
        raise bad_request("messages", f"the chat template refused them: {e}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


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
    if body.model not in (model.name, model.model_id):
        raise model_not_found(body.model, model.name)
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


def _sampling(body: _GenerateRequest, max_tokens: int, logprobs: int | None) -> dict:
    """The sampling fields that are set (unset ones take the engine's defaults on the workers)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    values = dict(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                  min_p=body.min_p, seed=body.seed, logprobs=logprobs)
    return dict({k: v for k, v in values.items() if v is not None}, stop=stop,
                stop_token_ids=list(body.stop_token_ids or []), ignore_eos=bool(body.ignore_eos))


def _job(body: _GenerateRequest, prompts: list, sampling: dict, slo_header: str | None, max_choices: int,
         logprobs: int | None, rename: dict[str, str]) -> Job:
    n = body.n if body.n is not None else 1
    if n < 1:
        raise bad_request("n", f"must be >= 1, got {n}")
    if n * len(prompts) > max_choices:
        raise bad_request("n" if len(prompts) == 1 else "prompt",
                          f"{n * len(prompts)} choices asked for; at most {max_choices} per request")
    if body.seed is not None and not 0 <= body.seed <= _INT64_MAX - n:
        raise bad_request("seed", f"must be in [0, 2^63 - n), got {body.seed}")
    request_id = uuid.uuid4().hex
    num_choices = n * len(prompts)
    requests = []
    for i in range(num_choices):
        run_sampling = dict(sampling, seed=sampling["seed"] + i % n) if "seed" in sampling else sampling
        run_id = request_id if num_choices == 1 else f"{request_id}-{i}"
        requests.append(_request(run_id, prompts[i // n], run_sampling, body, slo_header, rename))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Job(request_id, tuple(requests), tuple(i // n for i in range(num_choices)), bool(body.stream),
               include_usage, logprobs, rename)


def _request(request_id: str, prompt, sampling: dict, body: _GenerateRequest, slo_header: str | None,
             rename: dict[str, str]) -> router_pb2.GenerateRequest:
    msg = router_pb2.GenerateRequest(request_id=request_id, model=body.model,
                                     slo_class=body.slo_class or slo_header or "")
    if isinstance(prompt, str):
        msg.text = prompt
    else:
        _check_int32(rename.get("prompt_token_ids", "prompt_token_ids"), prompt)
        msg.token_ids.CopyFrom(common_pb2.TokenIds(ids=prompt))
    for name in ("max_tokens", "top_k"):
        if name in sampling:
            _check_int32(rename.get(name, name), [sampling[name]])
    _check_int32("stop_token_ids", sampling["stop_token_ids"])
    msg.sampling.CopyFrom(common_pb2.SamplingParams(**sampling))
    return msg


def _check_int32(param: str, values) -> None:
    # the wire's int32 fields would refuse these with a message naming no field
    if any(not -(1 << 31) <= v < (1 << 31) for v in values):
        raise bad_request(param, "a value is out of range")
