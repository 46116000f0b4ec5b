"""The messages one request streams back to its client, and the latencies they carry.

    disaggregated: [first token, from the PrefillResponse] [decode msg] ... [final]
    direct:        [decode msg] ... [final]
    resumed:       ... [decode msg] | the worker fails | [msg from another worker] ... [final]

A resumed request's new worker replays the tokens already sent through its detokenizer,
so its first message's text continues exactly where the last one's ended. With n > 1 each
completion has a stream of its own (choices.py); its messages carry its index.

Messages are filled in place, never copied: the first is built here from the prefill's
choice, the others are the decode's own, parsed for this stream alone. The final message
(finish_reason set) gets usage counted here, exactly as the client saw it, and timings
merged from every hop: the router's queue time and TTFT, the prefill's queue/compute/
KV-write parts and the decode's KV-read and join parts.
"""
from __future__ import annotations

import time

from pdserve.services.pb import common_pb2, prefill_pb2
from pdserve.services.router.core.request import RoutedRequest
from pdserve.services.router.metrics import RouterMetrics

_TIMING_FIELDS = [f.name for f in common_pb2.Timings.DESCRIPTOR.fields]


class ResponseStream:
    def __init__(self, req: RoutedRequest, arrival: float, metrics: RouterMetrics, label_req_id: str = ""):
        """`label_req_id`: the id its messages carry (a completion's, n > 1: its request's)."""
        self.req = req
        self.label_req_id = label_req_id or req.req_id
        self.arrival = arrival
        self.metrics = metrics
        self.first_call: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.token_ids: list[int] = []  # every token sent: a resumed request continues after them
        self._prefill_timings = common_pb2.Timings()  # the direct path: none
        self._cached_prompt_tokens: int | None = None  # from the prefill; None: the decode's count
        self._finished = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        """Whether the final message (finish_reason set) went out."""
        return self._finished

    @property
    def labels(self) -> tuple[str, str]:
        return self.req.slo_class, self.req.path

    def dispatched(self) -> None:
        """A worker call is about to start; the first one ends the router's queue time."""
        if self.first_call is None:
            self.first_call = time.monotonic()
            self.metrics.queue.labels(*self.labels).observe(self.first_call - self.arrival)

    def first_from_prefill(self, reply: prefill_pb2.PrefillResponse) -> common_pb2.GenerateResponse:
        """The first token of completion req.index: its choice in the reply."""
        self._prefill_timings = reply.timings  # read at the end, never written: the reply stays as it came
        self._cached_prompt_tokens = reply.num_cached_tokens  # completion 0's: what was cached before
        first = reply.choices[self.req.index]
        msg = common_pb2.GenerateResponse(req_id=self.label_req_id, token_ids=[first.token_id], text=first.text,
                                          finish_reason=first.finish_reason)
        if first.HasField("logprob"):
            msg.logprobs.append(first.logprob)
        if reply.HasField("prompt_logprobs"):
            msg.prompt_logprobs.CopyFrom(reply.prompt_logprobs)
        return self._account(msg)

    def forward(self, msg: common_pb2.GenerateResponse) -> common_pb2.GenerateResponse:
        """A decode worker's message, relabelled in place: parsed for this stream alone, it is
        the router's to change, so no copy per token."""
        msg.req_id = self.label_req_id
        return self._account(msg)

    def _account(self, msg: common_pb2.GenerateResponse) -> common_pb2.GenerateResponse:
        msg.index = self.req.index  # which of the request's n completions (0 for n = 1)
        if self.token_ids:  # the prompt's logprobs came with the first token: a retried worker's are dropped
            msg.ClearField("prompt_logprobs")
        if msg.token_ids:
            self._observe_tokens(len(msg.token_ids))
            self.token_ids.extend(msg.token_ids)
        if msg.finish_reason:
            self._finish(msg)
        return msg

    def _observe_tokens(self, num_tokens: int) -> None:
        t = time.monotonic()
        if self.first_token is None:
            self.first_token = t
            self.metrics.observe_ttft(*self.labels, t - self.arrival)
        else:
            # a message may carry several tokens: each waited its share of the gap
            self.metrics.observe_itl(*self.labels, (t - self.last_token) / num_tokens)
        self.last_token = t

    def _finish(self, msg: common_pb2.GenerateResponse) -> None:
        """Usage and timings filled in on the final message itself."""
        self._finished = True
        usage = msg.usage
        if self._cached_prompt_tokens is not None:  # else the decode's own count stands
            usage.cached_prompt_tokens = self._cached_prompt_tokens
        usage.prompt_tokens, usage.completion_tokens = len(self.req.prompt_token_ids), self.num_tokens
        timings = msg.timings
        for name in _TIMING_FIELDS:  # the decode's part where it measured one, else the prefill's
            if not getattr(timings, name):
                setattr(timings, name, getattr(self._prefill_timings, name))
        timings.router_queue_s = (self.first_call or self.arrival) - self.arrival
        timings.ttft_s = (self.first_token or time.monotonic()) - self.arrival
        msg.path = self.req.path
        self.metrics.e2e.labels(*self.labels).observe(time.monotonic() - self.arrival)
