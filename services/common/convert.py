"""Between protobuf messages and the engine's dataclasses."""
from __future__ import annotations

import math

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.outputs import PromptLogprobs, TokenLogprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.slo import SLOTargets
from pdserve.engine.structured import StructuredOutputsParams
from pdserve.services.pb import common_pb2

_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "min_tokens", "prompt_logprobs", "skip_special_tokens")


_SLO_FIELDS = ("ttft_budget_ms", "min_class_ttft_ms", "itl_target_ms")  # SLOTargets' order


def slo_from_proto(msg: common_pb2.SLOTargets) -> SLOTargets:
    """Milliseconds on the wire, seconds in the engine; a value that is negative, NaN or
    infinite raises InvalidRequestError naming the field as the caller sent it (slo.<field>)."""
    ms = [getattr(msg, name) for name in _SLO_FIELDS]
    for name, value in zip(_SLO_FIELDS, ms):
        if not (value >= 0 and math.isfinite(value)):
            raise InvalidRequestError(f"slo.{name}", f"must be a finite number >= 0 (0: none), got {value}")
    return SLOTargets(*(value / 1000 for value in ms))


def slo_to_proto(slo: SLOTargets) -> common_pb2.SLOTargets:
    return common_pb2.SLOTargets(ttft_budget_ms=slo.ttft_budget_s * 1000, min_class_ttft_ms=slo.min_class_ttft_s * 1000,
                                 itl_target_ms=slo.itl_target_s * 1000)


def sampling_from_proto(msg: common_pb2.SamplingParams, default_max_tokens: int = 16) -> SamplingParams:
    """Unset fields take the engine's defaults; raises InvalidRequestError naming a bad field."""
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
    kwargs.setdefault("max_tokens", default_max_tokens)
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_from_proto(msg.structured_outputs)
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.HasField("allowed_token_ids"):
        kwargs["allowed_token_ids"] = list(msg.allowed_token_ids.ids)
    return SamplingParams(stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
                          ignore_eos=msg.ignore_eos, bad_words=list(msg.bad_words),
                          include_stop_str_in_output=msg.include_stop_str_in_output, **kwargs)


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(stop=params.stop, stop_token_ids=params.stop_token_ids,
                                    ignore_eos=params.ignore_eos, bad_words=params.bad_words,
                                    logit_bias=params.logit_bias or {},
                                    include_stop_str_in_output=params.include_stop_str_in_output)
    for name in _OPTIONAL:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    if params.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(structured_to_proto(params.structured_outputs))
    if params.allowed_token_ids is not None:
        msg.allowed_token_ids.ids.extend(params.allowed_token_ids)
    return msg


def structured_from_proto(msg: common_pb2.StructuredOutputs) -> StructuredOutputsParams:
    """Raises InvalidRequestError naming the field (none or several specs set, ...)."""
    return StructuredOutputsParams(
        json=msg.json if msg.HasField("json") else None, regex=msg.regex if msg.HasField("regex") else None,
        choice=list(msg.choice.choices) if msg.HasField("choice") else None,
        grammar=msg.grammar if msg.HasField("grammar") else None, json_object=msg.json_object,
        disable_any_whitespace=msg.disable_any_whitespace)


def structured_to_proto(params: StructuredOutputsParams) -> common_pb2.StructuredOutputs:
    msg = common_pb2.StructuredOutputs(json_object=params.json_object,
                                       disable_any_whitespace=params.disable_any_whitespace)
    kind = params.kind
    if kind == "choice":
        msg.choice.choices.extend(params.choice)
    elif kind != "json_object":
        setattr(msg, kind, params.spec_text)
    return msg


def logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_logprobs=lp.top_logprobs)


def prompt_logprobs_to_proto(prompt_logprobs: PromptLogprobs, top_n: int) -> common_pb2.PromptLogprobs:
    """The engine's [None, {prompt token: Logprob, top N...}, ...] on the wire: each prompt
    token's own logprob and rank, and the N most likely of its position (the prompt token is
    among them when its entry holds no more than N)."""
    msg = common_pb2.PromptLogprobs()
    for entry in prompt_logprobs[1:]:
        (token_id, own), *others = entry.items()  # the prompt token's comes first
        top = {t: lp.logprob for t, lp in others}
        if len(entry) <= top_n:
            top[token_id] = own.logprob
        msg.tokens.append(common_pb2.TokenLogprob(token_id=token_id, logprob=own.logprob, top_logprobs=top))
        msg.ranks.append(own.rank)
    return msg
