"""The output processor on its own: stop strings, text held back while streaming, the
hand-off text rule and logprobs, over a one-character-per-token tokenizer."""
from __future__ import annotations

from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams


class CharTokenizer:
    """Token id i is chr(i): text and ids map one to one."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def started(params: SamplingParams, prompt: str = "Q:", output: str = "") -> tuple[OutputProcessor, Request]:
    processor = OutputProcessor(CharTokenizer())
    request = Request(EngineRequest("r", ids(prompt), params, output_token_ids=ids(output)))
    processor.add(request, prompt)
    return processor, request


def feed(processor: OutputProcessor, request: Request, text: str, logprobs=None) -> str | None:
    """One step of tokens, as the engine core runs it: stops at a matched stop string."""
    processor.start_step(request.req_id)
    for i, token_id in enumerate(ids(text)):
        request.append_output_token(token_id)
        if (matched := processor.append_token(request, logprobs[i] if logprobs else None)) is not None:
            return matched
        processor.emit_text(request.req_id)
    return None


def test_a_stop_string_ends_the_text_before_it():
    processor, request = started(SamplingParams(stop=["END"]))
    assert feed(processor, request, "hi EN") is None
    out = processor.step_output("r")
    assert out.new_text == "hi " and out.text == "hi EN"  # "EN" may begin the stop string: held back
    assert feed(processor, request, "Dx") == "END"
    request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, "END"
    final = processor.finish(request)
    assert final.text == "hi " and final.new_text == "" and final.stop_reason == "END"
    assert final.finish_reason == "stop" and final.token_ids == ids("hi END")


def test_include_stop_str_keeps_it_in_the_text():
    processor, request = started(SamplingParams(stop=["!"], include_stop_str_in_output=True))
    assert feed(processor, request, "ok!") == "!"
    request.status = RequestStatus.FINISHED_STOPPED
    assert processor.finish(request).text == "ok!"


def test_a_handoff_keeps_held_back_text_for_the_decode_worker():
    processor, request = started(SamplingParams(stop=["xyz"]))
    assert feed(processor, request, "abxy") is None
    request.status = RequestStatus.FINISHED_HANDOFF
    payload = object()  # stands for the prompt's KVPayload
    final = processor.finish(request, payload)
    # "xy" could begin the stop string: the decode worker, replaying the tokens, decides
    assert final.text == "ab" and final.new_text == "ab" and final.kv_export is payload


def test_a_real_end_releases_everything():
    processor, request = started(SamplingParams(stop=["xyz"]))
    feed(processor, request, "abxy")
    processor.flush("r")
    request.status = RequestStatus.FINISHED_LENGTH
    final = processor.finish(request)
    assert final.text == "abxy" and final.new_text == "abxy" and final.finish_reason == "length"


def test_an_abort_carries_no_step_delta():
    processor, request = started(SamplingParams())
    feed(processor, request, "ab")
    request.status = RequestStatus.FINISHED_ABORTED
    final = processor.finish(request)
    assert final.new_token_ids == [] and final.new_text == "" and final.finish_reason == "abort"
    assert "r" not in processor.req_ids


def test_logprobs_are_recorded_per_token_when_asked():
    processor, request = started(SamplingParams(logprobs=1))
    feed(processor, request, "ab", logprobs=[(-0.5, {97: -0.5}), (-1.0, {98: -1.0})])
    assert processor.step_output("r").logprobs == [TokenLogprob(97, -0.5, {97: -0.5}),
                                                    TokenLogprob(98, -1.0, {98: -1.0})]


def test_no_logprobs_list_unless_asked():
    processor, request = started(SamplingParams())
    feed(processor, request, "ab")
    assert processor.step_output("r").logprobs is None


def test_tokens_produced_elsewhere_are_in_the_output_but_not_streamed_again():
    processor, request = started(SamplingParams(), output="He")
    feed(processor, request, "llo")
    out = processor.step_output("r")
    assert out.token_ids == ids("Hello") and out.new_token_ids == ids("llo")
    assert out.new_text == "llo" and out.text == "Hello"
