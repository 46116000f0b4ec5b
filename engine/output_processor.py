"""Turns the engine's token ids into RequestOutputs: detokenizing, stop strings, logprobs
and the text rule at a hand-off. The engine core decides when a request ends; this
module only says which stop string a token completed and shapes what the caller sees.

One RequestOutput per request lives here from add() to finish(); each step overwrites
its step fields (new_token_ids, new_text) and grows its cumulative ones.
"""
from __future__ import annotations

import time

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.kv_transfer import KVPayload
from pdserve.engine.core.scheduler_output import PromptLogprobRows
from pdserve.engine.outputs import Logprob, PromptLogprobs, RequestOutput, TokenLogprob
from pdserve.engine.request import Request, RequestStatus


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._outputs: dict[str, RequestOutput] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        # prompt_logprobs being computed, chunk by chunk; handed to the output with the first token
        self._prompt_logprobs: dict[str, PromptLogprobs] = {}
        self._token_text: dict[int, str] = {}  # each token decoded alone; at most the vocabulary

    @property
    def req_ids(self) -> dict[str, RequestOutput]:
        """The requests with an output in progress (a mapping: `in` is all it is for)."""
        return self._outputs

    def add(self, request: Request, prompt: str | None) -> None:
        params = request.sampling_params
        # the output covers the whole completion, tokens produced elsewhere included
        # (keyed by the engine's req_id; labelled with the caller's and the completion's index)
        self._outputs[request.req_id] = RequestOutput(
            request.family.parent_req_id, prompt, list(request.prompt_token_ids), token_ids=list(request.output_token_ids),
            logprobs=[] if params.logprobs is not None else None, arrival_time=time.monotonic(),
            index=request.family.index)
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.stop,
                                       params.include_stop_str_in_output, params.min_tokens,
                                       params.skip_special_tokens)
        for token_id in request.output_token_ids:  # already streamed by whoever produced them
            detok.update(token_id)
            detok.take_delta(finished=False)
        self._detokenizers[request.req_id] = detok
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[request.req_id] = [None]  # the first prompt token has nothing before it

    def add_prompt_logprobs(self, req_id: str, rows: PromptLogprobRows) -> None:
        """A prompt chunk's logprobs, in prompt order. A preempted request computes its prompt
        again from the start: its rows overwrite the same positions; once the first token has
        taken them (a preemption while decoding), later ones are dropped."""
        acc = self._prompt_logprobs.get(req_id)
        if acc is None:
            return
        entries = []
        for token_id, logprob, rank, top in zip(rows.token_ids, rows.logprobs, rows.ranks, rows.top_logprobs):
            entry = {token_id: Logprob(logprob, rank, self._text_of(token_id))}
            for j, (t, v) in enumerate(sorted(top.items(), key=lambda kv: -kv[1])):
                entry.setdefault(t, Logprob(v, j + 1, self._text_of(t)))
            entries.append(entry)
        acc[rows.first:rows.first + len(entries)] = entries

    def _text_of(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def start_step(self, req_id: str) -> None:
        out = self._outputs[req_id]
        out.new_token_ids, out.new_text = [], ""

    def append_token(self, request: Request, logprob) -> str | None:
        """The request's newest token, into its output and detokenizer; returns the stop
        string it completed, if any. `logprob`: (logprob, top logprobs) or None."""
        out, token_id = self._outputs[request.req_id], request.all_token_ids[-1]
        if out.first_token_time is None:
            out.first_token_time = time.monotonic()
            out.first_scheduled_time = request.first_scheduled_time
            out.num_cached_tokens = max(request.num_cached_tokens, 0)
            out.prompt_logprobs = self._prompt_logprobs.pop(request.req_id, None)
        out.token_ids.append(token_id)
        out.new_token_ids.append(token_id)
        if logprob is not None:
            out.logprobs.append(TokenLogprob(token_id, logprob[0], logprob[1]))
        if _stops_by_its_id(request, token_id):  # vLLM: the token that ends it is not in its text
            return None
        return self._detokenizers[request.req_id].update(token_id)

    def emit_text(self, req_id: str) -> None:
        """The request goes on: the text that can no longer change joins this step's."""
        self._outputs[req_id].new_text += self._detokenizers[req_id].take_delta(finished=False)

    def flush(self, req_id: str) -> None:
        """The request ends on a token, not a stop string: nothing more can match."""
        self._detokenizers[req_id].flush()

    def step_output(self, req_id: str) -> RequestOutput:
        out = self._outputs[req_id]
        out.text = self._detokenizers[req_id].output_text
        return out

    def finish(self, request: Request, kv_export: KVPayload | None = None) -> RequestOutput:
        """The final output; a hand-off's carries the prompt's KV. At a hand-off, text the
        detokenizer holds back (a partial character, a possible stop string) stays held: the
        decode worker's detokenizer replays the tokens and emits it there. An aborted
        request's step carries nothing."""
        out = self._outputs.pop(request.req_id)
        detok = self._detokenizers.pop(request.req_id)
        self._prompt_logprobs.pop(request.req_id, None)
        handoff = request.status == RequestStatus.FINISHED_HANDOFF
        if request.status != RequestStatus.FINISHED_ABORTED:
            out.new_text += detok.take_delta(finished=not handoff)
        else:
            out.new_token_ids, out.new_text = [], ""
        out.text = detok.emitted_text if handoff else detok.output_text
        out.finish_reason = request.finish_reason
        out.stop_reason = request.stop_reason
        out.finished_time = time.monotonic()
        out.kv_export = kv_export
        return out


def _stops_by_its_id(request: Request, token_id: int) -> bool:
    """Whether this token ends the request by its id (EOS, a stop token: Scheduler.check_stop)
    and stays out of the text, which only include_stop_str_in_output keeps it in (vLLM's rule;
    with skip_special_tokens an EOS's text is empty anyway)."""
    params = request.sampling_params
    stops = (not params.ignore_eos and token_id in request.eos_token_ids) or token_id in params.stop_token_ids
    return stops and not params.include_stop_str_in_output
