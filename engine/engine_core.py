"""EngineCore: the step loop. schedule -> execute (one flat batch) -> sample -> update.

It decides when a request ends (EOS, a stop token or string, a length limit, a complete
grammar, a hand-off); its output processor turns the new tokens into text, and step()
returns RequestOutputs with both. A request's checks: engine/validation.py; its n
completions: engine/parallel_sampling.py; the load it reports: engine/load_report.py.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.core.kv_cache_manager import KVCacheManager
from pdserve.engine.core.cache_events import KVEvents
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.engine_setup import (engine_info, make_drafting, model_naming, pick_attention_backend,
                                         resolve_scheduler_config, size_kv_cache)
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.executor.start import start_executor
from pdserve.engine.kv_export import KVExporter
from pdserve.engine.kv_transfer import KVPayload
from pdserve.engine.load_report import engine_stats
from pdserve.engine.model.loader import LoadedModel, parse_dtype
from pdserve.engine.model.source import resolve_model
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.parallel_sampling import Families, family_requests
from pdserve.engine.request import Request, RequestMode, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.stats import EngineStats
from pdserve.engine.step_rates import StepRates
from pdserve.engine.structured.manager import NoStructuredOutputs, StructuredOutputManager
from pdserve.engine.validation import check_engine_request
from pdserve.engine.worker.host_malloc import keep_freed_memory
from pdserve.engine.worker.kv_cache import allocate_kv_caches
from pdserve.engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, progress: bool = True, loaded: LoadedModel | None = None):
        """`loaded`: weights already in memory (several engines over one model, as in tests)."""
        self.config = config
        self.source = resolve_model(config.model, config.revision)
        self.dtype = parse_dtype(config.dtype)
        device = torch.device(config.device)
        backend = pick_attention_backend(config)
        self.executor = start_executor(config, self.source, self.dtype, loaded, progress)
        self.loaded = self.executor.loaded  # with t x p ranks rank 0's part; arch and tokenizer whole
        self.tokenizer = self.loaded.tokenizer
        arch, cache = self.loaded.arch, config.cache
        size = size_kv_cache(config, self.executor, self.loaded, backend, self.dtype, device)
        num_blocks, num_host_slots, self.max_model_len = size.num_blocks, size.num_host_slots, size.max_model_len
        self.model_key, self.root_hash = model_naming(self.source, self.dtype, arch, cache.block_size,
                                                      cache.block_names_key, config.quantization)
        self.kv_manager = KVCacheManager(num_blocks, cache.block_size, self.root_hash,
                                         cache.enable_prefix_caching, window=arch.max_window,
                                         num_host_slots=num_host_slots)
        self.step_rates = StepRates()  # measured by step(), read by the scheduler's time bound (max_step_ms)
        self.scheduler = Scheduler(resolve_scheduler_config(config.scheduler, self.max_model_len), self.kv_manager,
                                   self.step_rates)
        if device.type == "cpu":
            keep_freed_memory()
        kv_caches = allocate_kv_caches(num_blocks, self.executor.kv_arch, cache.block_size, self.dtype, device)
        self.executor.start_kv(num_blocks, kv_caches, backend, num_host_slots)
        self.runner = ModelRunner(self.loaded.model, kv_caches, cache.block_size, backend, device, config.seed,
                                  executor=self.executor, eos_token_ids=self.loaded.eos_token_ids)
        if config.cuda_graph_batch_sizes:
            self.runner.capture_decode_graphs(config.cuda_graph_batch_sizes, self.max_model_len,
                                              self.scheduler.config.max_num_seqs)
        self.info = engine_info(config, self.model_key, arch, self.dtype, self.max_model_len,
                                self.scheduler.config.max_num_seqs, self.root_hash)
        self.outputs = OutputProcessor(self.tokenizer)
        self.families = Families()  # requests with n > 1 (parallel_sampling.py)
        self._aborted: list[RequestOutput] = []
        self.exporter = KVExporter(self.kv_manager, self.runner, self.info.kv_layout)
        self.grammars: StructuredOutputManager | NoStructuredOutputs = NoStructuredOutputs(self._build_structured)
        self.drafting = make_drafting(config, self.source.path, self.loaded, self.executor.holds_whole_model,
                                      self.dtype, num_blocks, self.max_model_len)
        self.proposer = self.drafting.proposer

    def check_health(self) -> None:
        """Raises EngineDeadError once a tensor/pipeline rank has died (the engine cannot step)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stops the rank processes (t x p > 1)."""
        self.executor.shutdown()

    def _build_structured(self) -> StructuredOutputManager:
        return StructuredOutputManager(self.tokenizer, self.loaded.arch.vocab_size, self.loaded.eos_token_ids,
                                       self.config.structured_outputs_compile_timeout_s)

    @property
    def structured(self) -> StructuredOutputManager:
        """Grammars and matchers, built by the first guided request (or this call)."""
        self.grammars = self.grammars.for_guided()
        return self.grammars

    # ---- requests --------------------------------------------------------------------
    def add_request(self, new: EngineRequest) -> None:
        """Validate and queue a request; a bad one raises InvalidRequestError and changes nothing."""
        new = check_engine_request(new, self.info, self.tokenizer, self.outputs.req_ids)
        # n > 1: n requests sharing the prompt, queued together, the first first (parallel_sampling.py)
        for request in family_requests(new, self.loaded.eos_token_ids):
            self.outputs.add(request, new.prompt)
            if request.sampling_params.structured_outputs is not None:
                self.structured.add(request)  # the scheduler gets it once its grammar is compiled
            else:
                self.scheduler.add_request(request)
        self.families.add(new.req_id, new.params.n)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The checks of add_request, without queueing anything."""
        self.info.validate(prompt_token_ids, params)

    def abort_request(self, req_id: str) -> None:
        """Stop a request (every one of its n completions) and free its blocks; its final
        outputs come with the next step."""
        req_ids = self.families.req_ids(req_id)
        for request in self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED):
            self._aborted.append(self._finish_output(request))
        for child_id in req_ids:
            if (request := self.grammars.remove(child_id)) is not None:
                request.status = RequestStatus.FINISHED_ABORTED
                self._aborted.append(self._finish_output(request))

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self._aborted)
                or self.grammars.num_pending > 0)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar finished compiling go to the scheduler; those whose
        grammar failed end with the error (the outputs)."""
        if not self.grammars.num_pending:
            return []
        ready, failed = self.grammars.poll()
        for request in ready:
            self.scheduler.add_request(request)
        ended = []
        for request, error in failed:
            request.status = RequestStatus.FINISHED_ABORTED
            out = self._finish_output(request)
            out.error = str(error)
            ended.append(out)
        return ended

    # ---- the loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns the outputs of requests that advanced or ended."""
        outputs, self._aborted = self._aborted, []
        outputs += self._admit_compiled()
        start = time.perf_counter()
        self.drafting.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched.is_empty and not sched.finished_req_ids and not sched.has_host_copies:
            if self.grammars.num_pending and not outputs:
                time.sleep(0.001)  # only grammars compiling: do not spin a core against them
            return outputs
        sched.grammar_bitmask = self.grammars.step_bitmask(sched, self.scheduler.requests)
        result = self.runner.execute_model(sched)
        self.drafting.count(sched.spec_token_ids, result.sampled_token_ids, self.scheduler.requests)
        for req_id, rows in result.prompt_logprobs.items():  # before the first token, which takes them
            self.outputs.add_prompt_logprobs(req_id, rows)
        for request, token_ids in self.scheduler.update_from_output(sched, result):
            outputs.append(self._process_tokens(request, token_ids, result.logprobs.get(request.req_id)))
        # a one-token chunk of a prompt counts as a decode: too small to matter either way
        num_decodes = sum(1 for n in sched.num_scheduled_tokens.values() if n == 1)
        self.step_rates.observe(sched.total_num_scheduled_tokens - num_decodes, num_decodes,
                                time.perf_counter() - start)
        return outputs

    def _fail(self, request: Request, field: str, reason: str) -> RequestOutput:
        self.scheduler.finish_requests([request.req_id], RequestStatus.FINISHED_ABORTED)
        out = self._finish_output(request)
        out.error = str(InvalidRequestError(field, reason))
        return out

    def _process_tokens(self, request: Request, token_ids: list[int], logprobs) -> RequestOutput:
        """This step's tokens of the request, one at a time: a stop (EOS, a stop string or
        token, a length limit, a complete grammar) ends it there and drops the tokens after."""
        self.outputs.start_step(request.req_id)
        for i, token_id in enumerate(token_ids):
            request.append_output_token(token_id)
            if not StructuredOutputManager.accept(request, token_id):
                return self._fail(request, "structured_outputs", "the sampled token is not allowed by the "
                                                                 "grammar (an engine bug; see the log)")
            matched_stop = self.outputs.append_token(request, logprobs[i] if logprobs else None)
            status = self._finish_status(request, matched_stop)
            if status is not None:
                return self._finish(request, status, matched_stop)
            self.outputs.emit_text(request.req_id)
        return self.outputs.step_output(request.req_id)

    def _finish(self, request: Request, status: RequestStatus, matched_stop: str | None) -> RequestOutput:
        handoff = status == RequestStatus.FINISHED_HANDOFF
        # before its blocks are freed; n > 1: the first completion to hand off exports the shared prompt's
        kv_export = self.exporter.handoff(request) if handoff and self.families.takes_kv_export(request) else None
        if not handoff and matched_stop is None:  # (a stop string's text is already cut at the match)
            self.outputs.flush(request.req_id)
        self.scheduler.finish_requests([request.req_id], status)
        return self._finish_output(request, kv_export)

    def _finish_status(self, request: Request, matched_stop: str | None) -> RequestStatus | None:
        """Why the request ends after its newest token; None: it goes on here. A real end
        (a stop string, EOS, a stop token, a length limit) wins over a hand-off."""
        if matched_stop is not None:
            request.stop_reason = matched_stop
            return RequestStatus.FINISHED_STOPPED
        status = self.scheduler.check_stop(request)
        if status is None and request.grammar is not None and request.grammar.terminated:
            status = RequestStatus.FINISHED_STOPPED  # the grammar is complete: nothing may follow
        if status is None and request.mode == RequestMode.PREFILL_ONLY:
            return RequestStatus.FINISHED_HANDOFF
        return status

    def _finish_output(self, request: Request, kv_export: KVPayload | None = None) -> RequestOutput:
        self.drafting.finish(request.req_id)
        self.families.finished(request)
        return self.outputs.finish(request, kv_export)

    def export_cached_blocks(self, block_hashes: list[bytes]) -> KVPayload | None:
        """The KV of the leading run of `block_hashes` still in the prefix cache (full
        blocks, every token's KV computed), e.g. a finished request's prompt and answer;
        None when not even the first is held. See engine/cached_kv_export.py."""
        return self.exporter.cached(block_hashes)

    def set_kv_export_allocator(self, allocate: Callable[[int], torch.Tensor | None] | None) -> None:
        """Where exported KV goes: engine/kv_export.py."""
        self.exporter.set_allocator(allocate)

    # ---- introspection ---------------------------------------------------------------
    def num_local_prefix_blocks(self, block_hashes: list[bytes]) -> int:
        """The leading blocks a request would find here, in the device cache or the host tier."""
        return self.kv_manager.num_local_blocks(block_hashes)

    def take_kv_events(self) -> KVEvents:
        """The prefix cache's stored/removed block hashes since the last call, each naming
        its tier (see engine/core/cache_events.py); a worker publishes them to routers between steps."""
        return self.kv_manager.pool.take_kv_events()

    def stats(self) -> EngineStats:
        return engine_stats(self.scheduler, self.step_rates, self.grammars.num_pending, self.drafting.stats,
                            self.max_model_len)
