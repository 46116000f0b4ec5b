"""SamplingParams across the wire (common.proto) and back: every field, unset ones the engine's defaults."""
from __future__ import annotations

import pytest

from pdserve.engine import InvalidRequestError, SamplingParams
from pdserve.services.common.convert import sampling_from_proto, sampling_to_proto
from pdserve.services.pb import common_pb2


def test_logits_fields_round_trip():
    params = SamplingParams(max_tokens=9, temperature=0, repetition_penalty=1.5, presence_penalty=-0.5,
                            frequency_penalty=0.25, logit_bias={3: -100.0, 70: 2.5}, min_tokens=4,
                            bad_words=["foo", "bar baz"], allowed_token_ids=[3, 70, 71])
    back = sampling_from_proto(common_pb2.SamplingParams.FromString(sampling_to_proto(params).SerializeToString()))
    assert back == params  # (these values are exact as float32)


def test_unset_fields_are_the_engines_defaults():
    back = sampling_from_proto(common_pb2.SamplingParams())
    assert (back.repetition_penalty, back.presence_penalty, back.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (back.logit_bias, back.min_tokens, back.bad_words, back.allowed_token_ids) == (None, 0, [], None)
    assert not back.processes_logits


def test_an_empty_allowed_list_is_told_from_none():
    msg = common_pb2.SamplingParams()
    msg.allowed_token_ids.SetInParent()
    with pytest.raises(InvalidRequestError) as e:
        sampling_from_proto(msg)
    assert e.value.field == "allowed_token_ids"


def test_prompt_logprobs_and_text_fields_round_trip():
    params = SamplingParams(prompt_logprobs=3, include_stop_str_in_output=True, skip_special_tokens=False, stop=["x"])
    back = sampling_from_proto(common_pb2.SamplingParams.FromString(sampling_to_proto(params).SerializeToString()))
    assert back == params
    unset = sampling_from_proto(common_pb2.SamplingParams())
    assert (unset.prompt_logprobs, unset.include_stop_str_in_output, unset.skip_special_tokens) == (None, False, True)
