"""The TPOT room a worker reports: how long its running streams could still be paused and
keep their mean inter-token time within their targets."""
from __future__ import annotations

import math

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.core.tpot_room import stream_room_s, tpot_stall_room_s
from pdserve.engine.request import Request
from pdserve.engine.slo import SLOTargets
from pdserve.engine.engine_request import EngineRequest

MAX_LEN = 2048


def _stream(max_tokens: int, given: int = 0, produced: int = 0, itl_target_s: float = 0.15,
            arrival: float = 100.0, prompt_len: int = 10) -> Request:
    """A stream that arrived at `arrival` with `given` tokens, then produced `produced` more."""
    request = Request(EngineRequest("r", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                                    output_token_ids=[5] * given, slo=SLOTargets(itl_target_s=itl_target_s)),
                      arrival_time=arrival)
    for _ in range(produced):
        request.append_output_token(7)
    return request


def test_a_decode_only_stream_counts_from_the_token_it_was_given():
    # 101 tokens at 150 ms: 15 s for the 100 gaps after the first; 4 s spent on 40 of them,
    # 60 left at 50 ms: 15 - 4 - 3 = 8 s of room
    request = _stream(max_tokens=101, given=1, produced=40)
    assert request.tpot_anchor == (100.0, 1)
    assert stream_room_s(request, now=104.0, step_s=0.05, max_model_len=MAX_LEN) == pytest.approx(8.0)
    # a stream already late on its mean has none
    assert stream_room_s(request, now=115.0, step_s=0.05, max_model_len=MAX_LEN) < 0


def test_a_resumed_stream_keeps_its_target_over_the_tokens_still_to_come():
    # 30 tokens given on resume: the 20 still to come may take 20 x 150 ms = 3 s
    request = _stream(max_tokens=50, given=30, produced=0)
    assert stream_room_s(request, now=100.5, step_s=0.1, max_model_len=MAX_LEN) == pytest.approx(3.0 - 0.5 - 2.0)


def test_a_stream_counts_from_its_first_token_here(monkeypatch):
    request = _stream(max_tokens=11)
    assert request.tpot_anchor is None  # still in prefill: its TTFT, not its TPOT, is at stake
    assert stream_room_s(request, now=200.0, step_s=0.05, max_model_len=MAX_LEN) is None
    monkeypatch.setattr("pdserve.engine.request.time.monotonic", lambda: 150.0)
    request.append_output_token(7)
    assert request.tpot_anchor == (150.0, 1)
    # 10 gaps at 150 ms = 1.5 s, none spent, 10 to come at 50 ms: 1 s
    assert stream_room_s(request, now=150.0, step_s=0.05, max_model_len=MAX_LEN) == pytest.approx(1.0)


def test_the_context_bounds_the_tokens_counted():
    # max_tokens 1000 but 40 tokens of context left after a 2008-token prompt: 40 x 150 ms
    request = _stream(max_tokens=1000, given=1, prompt_len=MAX_LEN - 40)
    assert stream_room_s(request, now=100.0, step_s=0.05, max_model_len=MAX_LEN) == pytest.approx(
        39 * 0.15 - 39 * 0.05)


def test_streams_without_a_target_or_a_token_to_come_have_no_say():
    assert stream_room_s(_stream(max_tokens=50, given=1, itl_target_s=0), 100.0, 0.05, MAX_LEN) is None
    assert stream_room_s(_stream(max_tokens=5, given=1, produced=4), 100.0, 0.05, MAX_LEN) is None


def test_the_worker_reports_the_least_room_never_below_zero():
    roomy, tight = _stream(max_tokens=101, given=1), _stream(max_tokens=11, given=1)
    untargeted = _stream(max_tokens=11, given=1, itl_target_s=0)
    assert tpot_stall_room_s([roomy, tight, untargeted], 100.0, 0.05, MAX_LEN) == pytest.approx(1.0)
    assert tpot_stall_room_s([roomy, tight], 101.5, 0.05, MAX_LEN) == 0.0  # tight is late
    assert tpot_stall_room_s([untargeted], 100.0, 0.05, MAX_LEN) == math.inf
    assert tpot_stall_room_s([], 100.0, 0.05, MAX_LEN) == math.inf
    # an unmeasured decode step: nothing known of their pace
    assert tpot_stall_room_s([roomy], 100.0, 0.0, MAX_LEN) == 0.0
