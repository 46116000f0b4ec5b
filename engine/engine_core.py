"""EngineCore: the step loop. schedule -> execute (one flat batch) -> sample -> update."""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from engine.attention.backend import get_attention_backend
from engine.config import EngineConfig, SchedulerConfig
from engine.core.block_hash import check_cache_salt, model_fingerprint
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_events import KVEvents
from engine.core.scheduler import Scheduler
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.executor.start import start_executor
from engine.info import EngineInfo
from engine.model.loader import LoadedModel, load_model, parse_dtype
from engine.model.source import resolve_model
from engine.outputs import RequestOutput, TokenLogprob
from engine.request import Request, RequestMode, RequestStatus
from engine.sampling_params import SamplingParams
from engine.dtypes import dtype_name
from engine.kv_transfer import KVLayout, KVPayload
from engine.stats import EngineStats
from engine.structured.manager import StructuredOutputManager
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.proposer import DraftRequest, Proposer
from engine.step_rates import StepRates
from engine.validation import validate_mode, validate_request, validate_transfer
from engine.worker.kv_cache import allocate_kv_caches, bytes_per_block, num_kv_blocks
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, progress: bool = True, loaded: LoadedModel | None = None):
        """`loaded`: weights already in memory (several engines over one model, as in tests)."""
        self.config = config
        self.source = resolve_model(config.model)
        self.dtype = parse_dtype(config.dtype)
        device = torch.device(config.device)
        if config.attention_backend == "cpu" and device.type != "cpu":
            raise ValueError(f"attention_backend 'cpu' runs on the CPU only; on device {config.device!r} "
                             "use 'triton' (or 'torch', the pure torch reference)")
        backend = get_attention_backend(config.attention_backend)
        self.executor = start_executor(config, self.source, self.dtype, loaded, progress)
        if self.executor is not None:
            self.loaded = self.executor.loaded  # rank 0's part of the model; arch and tokenizer whole
        else:
            self.loaded = loaded or load_model(self.source, self.dtype, config.device,
                                               config.scheduler.max_model_len, progress)
        self.tokenizer = self.loaded.tokenizer
        arch, cache = self.loaded.arch, config.cache
        # a rank's KV cache holds its layers and KV heads only: the budget is per rank
        kv_arch = arch if self.executor is None else self.executor.kv_arch
        num_blocks = num_kv_blocks(cache, kv_arch, self.dtype, device, config.parallel.world_size)
        self.max_model_len = self._resolve_max_model_len(num_blocks)
        self.root_hash = model_fingerprint(self.source.model_id, str(self.dtype), arch.num_layers,
                                           arch.num_kv_heads, arch.head_dim, cache.block_size)
        self.kv_manager = KVCacheManager(num_blocks, cache.block_size, self.root_hash,
                                         cache.enable_prefix_caching)
        self.scheduler = Scheduler(self._resolve_scheduler_config(), self.kv_manager)
        kv_caches = allocate_kv_caches(num_blocks, kv_arch, cache.block_size, self.dtype, device)
        if self.executor is not None:
            self.executor.start_kv(num_blocks, kv_caches, backend)
        self.runner = ModelRunner(self.loaded.model, kv_caches, cache.block_size, backend, device, config.seed,
                                  executor=self.executor)
        if config.cuda_graph_batch_sizes:
            self.runner.capture_decode_graphs(config.cuda_graph_batch_sizes, self.max_model_len,
                                              self.scheduler.config.max_num_seqs)
        block_shape = (arch.num_layers, 2, cache.block_size, arch.num_kv_heads, arch.head_dim)
        self.info = EngineInfo(cache.block_size, self.max_model_len, arch.vocab_size,
                               self.scheduler.config.max_num_seqs, self.root_hash, block_shape,
                               KVLayout(self.source.model_id, dtype_name(self.dtype), block_shape, self.root_hash))
        self._outputs: dict[str, RequestOutput] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._aborted: list[RequestOutput] = []
        self.step_rates = StepRates()
        self._structured: StructuredOutputManager | None = None  # built by the first guided request
        self.proposer = self._make_proposer(num_blocks)
        self._spec_counts = {"proposed": 0, "accepted": 0, "verifications": 0}

    def check_health(self) -> None:
        """Raises EngineDeadError once a tensor/pipeline rank has died (the engine cannot step)."""
        if self.executor is not None:
            self.executor.check_health()

    def shutdown(self) -> None:
        """Stops the rank processes (t x p > 1); a single-rank engine has nothing to stop."""
        if self.executor is not None:
            self.executor.shutdown()

    def _make_proposer(self, num_blocks: int) -> Proposer | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        from engine.spec_decode.draft_model import DraftModelProposer, check_same_tokenizer
        source = resolve_model(spec.model)
        reuse = source.model_id == self.source.model_id and self.executor is None  # a rank's part is not the model
        draft = self.loaded if reuse else load_model(
            source, self.dtype, self.config.device, self.max_model_len, progress=False)
        check_same_tokenizer(self.tokenizer, draft.tokenizer)
        bs = self.config.cache.block_size
        # room for as many tokens as the target's cache holds
        return DraftModelProposer(draft, spec.num_speculative_tokens, self.config.device, self.dtype,
                                  num_blocks * bytes_per_block(draft.arch, bs, self.dtype), bs,
                                  self.config.attention_backend,
                                  vocab_limit=len(self.tokenizer), max_model_len=self.max_model_len)

    @property
    def structured(self) -> StructuredOutputManager:
        """Grammars and matchers (its tokenizer table takes ~0.3 s: built on first use)."""
        if self._structured is None:
            self._structured = StructuredOutputManager(self.tokenizer, self.loaded.arch.vocab_size,
                                                       self.loaded.eos_token_ids,
                                                       self.config.structured_outputs_compile_timeout_s)
        return self._structured

    def _resolve_max_model_len(self, num_blocks: int) -> int:
        wanted = self.config.scheduler.max_model_len or self.loaded.arch.max_position_embeddings
        capacity = num_blocks * self.config.cache.block_size
        if wanted > capacity:
            logger.warning("max_model_len lowered from %d to %d tokens: the KV cache holds %d blocks",
                           wanted, capacity, num_blocks)
        return min(wanted, capacity)

    def _resolve_scheduler_config(self) -> SchedulerConfig:
        config = self.config.scheduler
        budget = config.max_num_batched_tokens or self.max_model_len
        # Unsplit, a prompt longer than the budget could never be scheduled (vLLM's rule).
        if not config.enable_chunked_prefill and budget < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens: {budget} is smaller than max_model_len "
                             f"({self.max_model_len}); with chunked prefill off it must be at least "
                             "max_model_len, or lower max_model_len")
        return dataclasses.replace(config, max_num_batched_tokens=budget, max_model_len=self.max_model_len)

    # ---- requests --------------------------------------------------------------------
    def add_request(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, *, mode: RequestMode = RequestMode.COLOCATED,
                    output_token_ids: list[int] = (), kv_import: KVPayload | None = None,
                    priority: int = 0, prefill_chunk_tokens: int = 0, cache_salt: str = "") -> None:
        """Validate and queue a request; a bad one raises InvalidRequestError and changes nothing.

        Disaggregated serving (see RequestMode): a prefill worker adds PREFILL_ONLY requests
        (a handed-off output carries the prompt's KV) and may pass a cached prefix as
        `kv_import`; a decode worker adds DECODE_ONLY ones, with the tokens the prefill
        emitted as `output_token_ids` and the prompt's KV as `kv_import`.
        `prefill_chunk_tokens` caps this request's prefill chunks below the engine's own.
        `cache_salt`: the request shares cached KV only with requests of the same salt.
        """
        info = self.info
        validate_request(req_id, prompt_token_ids, params, info.max_model_len, info.vocab_size, self._outputs)
        validate_mode(mode, output_token_ids)
        validate_transfer(prompt_token_ids, output_token_ids, kv_import, info.kv_block_shape, info.vocab_size)
        if prefill_chunk_tokens < 0:
            raise InvalidRequestError("prefill_chunk_tokens", f"must be >= 0 (0: no cap), got {prefill_chunk_tokens}")
        if (problem := check_cache_salt(cache_salt)) is not None:
            raise InvalidRequestError("cache_salt", problem)
        request = Request(req_id, prompt_token_ids, params, self.loaded.eos_token_ids,
                          output_token_ids=output_token_ids, kv_import=kv_import, mode=mode, priority=priority,
                          prefill_chunk_tokens=prefill_chunk_tokens, cache_salt=cache_salt)
        # the output covers the whole completion, tokens produced elsewhere included
        out = RequestOutput(req_id, prompt, list(prompt_token_ids), token_ids=list(output_token_ids),
                            logprobs=[] if params.logprobs is not None else None, arrival_time=time.monotonic())
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.stop,
                                       params.include_stop_str_in_output)
        for token_id in output_token_ids:  # already streamed by whoever produced them
            detok.update(token_id)
            detok.take_delta(finished=False)
        self._outputs[req_id], self._detokenizers[req_id] = out, detok
        if params.structured_outputs is not None:
            self.structured.add(request)  # the scheduler gets it once its grammar is compiled
        else:
            self.scheduler.add_request(request)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The checks of add_request, without queueing anything."""
        self.info.validate(prompt_token_ids, params)

    def abort_request(self, req_id: str) -> None:
        """Stop a request and free its blocks; its final output comes with the next step."""
        for request in self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED):
            self._aborted.append(self._finish_output(request))
        if self._structured is not None and (request := self._structured.remove(req_id)) is not None:
            request.status = RequestStatus.FINISHED_ABORTED
            self._aborted.append(self._finish_output(request))

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self._aborted)
                or (self._structured is not None and self._structured.num_pending > 0))

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar finished compiling go to the scheduler; those whose
        grammar failed end with the error (the outputs)."""
        if self._structured is None or not self._structured.num_pending:
            return []
        ready, failed = self._structured.poll()
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
        self._propose_drafts()
        sched = self.scheduler.schedule()
        if sched.is_empty and not sched.finished_req_ids:
            if self._structured is not None and self._structured.num_pending and not outputs:
                time.sleep(0.001)  # only grammars compiling: do not spin a core against them
            return outputs
        if self._structured is not None:
            sched.grammar_bitmask = self._structured.bitmask(self._sampling_requests(sched), sched.spec_token_ids)
        result = self.runner.execute_model(sched)
        self._count_spec(sched, result)
        for request, token_ids in self.scheduler.update_from_output(sched, result):
            outputs.append(self._process_tokens(request, token_ids, result.logprobs.get(request.req_id)))
        # a one-token chunk of a prompt counts as a decode: too small to matter either way
        num_decodes = sum(1 for n in sched.num_scheduled_tokens.values() if n == 1)
        self.step_rates.observe(sched.total_num_scheduled_tokens - num_decodes, num_decodes,
                                time.perf_counter() - start)
        return outputs

    def _propose_drafts(self) -> None:
        """Draft tokens for the running requests that decode this step (none for a prefill-
        only request, or when the batch is past disable_by_batch_size). Drafts never take a
        request past max_tokens or the context, nor a guided one outside its grammar."""
        spec, running = self.config.speculative_config, self.scheduler.running
        if self.proposer is None or (spec.disable_by_batch_size and len(running) > spec.disable_by_batch_size):
            return
        wanted = []
        for request in running:
            if request.spec_pause > 0:
                request.spec_pause -= 1
                continue
            room = min(spec.num_speculative_tokens, request.sampling_params.max_tokens - request.num_output_tokens - 1,
                       self.max_model_len - request.num_tokens - 1)
            if (room >= 1 and request.num_tokens - request.num_computed_tokens == 1
                    and request.mode != RequestMode.PREFILL_ONLY):
                wanted.append(DraftRequest(request.req_id, request.all_token_ids, room))
        if wanted:
            drafts = self.proposer.propose(wanted)
            for want in wanted:
                request = self.scheduler.requests[want.req_id]
                # a guided request keeps the drafts its grammar allows (structured outputs)
                request.spec_token_ids = StructuredOutputManager.check_drafts(
                    request, list(drafts.get(want.req_id, ()))[:want.max_drafts])

    def _count_spec(self, sched, result) -> None:
        """Counts drafts proposed and kept. A request whose drafts all fail pauses its
        proposals for 2, 4, ... 16 steps (reset by the next kept draft): on text the
        proposer cannot guess (n-gram lookup on fresh prose), verifying k wrong drafts
        costs more than the plain step it replaces, and exactness does not depend on it."""
        for req_id, drafts in sched.spec_token_ids.items():
            if req_id in result.sampled_token_ids:
                accepted = len(result.sampled_token_ids[req_id]) - 1
                self._spec_counts["proposed"] += len(drafts)
                self._spec_counts["accepted"] += accepted
                self._spec_counts["verifications"] += 1
                request = self.scheduler.requests.get(req_id)
                if request is not None:
                    request.spec_misses = 0 if accepted else request.spec_misses + 1
                    request.spec_pause = min(2 ** request.spec_misses, 16) if request.spec_misses else 0

    def _sampling_requests(self, sched) -> list[Request]:
        """The scheduled requests that sample a token this step (their known tokens, and
        any drafts, are all computed by its end)."""
        requests, drafts = self.scheduler.requests, sched.spec_token_ids
        return [r for r in (requests.get(req_id) for req_id in sched.num_scheduled_tokens)
                if r is not None and r.num_computed_tokens == r.num_tokens + len(drafts.get(r.req_id, ()))]

    def _fail(self, request: Request, field: str, reason: str) -> RequestOutput:
        self.scheduler.finish_requests([request.req_id], RequestStatus.FINISHED_ABORTED)
        out = self._finish_output(request)
        out.error = str(InvalidRequestError(field, reason))
        return out

    def _process_tokens(self, request: Request, token_ids: list[int], logprobs) -> RequestOutput:
        """This step's tokens of the request, one at a time: a stop (EOS, a stop string or
        token, a length limit, a complete grammar) ends it there and drops the tokens after."""
        out, detok = self._outputs[request.req_id], self._detokenizers[request.req_id]
        out.new_token_ids, new_text = [], ""
        for i, token_id in enumerate(token_ids):
            request.append_output_token(token_id)
            if not StructuredOutputManager.accept(request, token_id):
                return self._fail(request, "structured_outputs", "the sampled token is not allowed by the "
                                                                 "grammar (an engine bug; see the log)")
            matched_stop = self._record_token(request, out, detok, logprobs[i] if logprobs else None)
            status = self._finish_status(request, matched_stop)
            if status is None:
                new_text += detok.take_delta(finished=False)
                continue
            if status == RequestStatus.FINISHED_HANDOFF:
                out.kv_export = self._export_kv(request)
            elif matched_stop is None:  # (a stop string's text is already cut at the match)
                detok.flush()
            self.scheduler.finish_requests([request.req_id], status)
            final = self._finish_output(request)
            final.new_text = new_text + final.new_text
            return final
        out.text = detok.output_text
        out.new_text = new_text
        return out

    def _record_token(self, request: Request, out: RequestOutput, detok: IncrementalDetokenizer,
                      logprob) -> str | None:
        """The token just sampled, into the output and the detokenizer; returns the stop
        string it completed, if any."""
        token_id = request.all_token_ids[-1]
        if out.first_token_time is None:
            out.first_token_time = time.monotonic()
            out.first_scheduled_time = request.first_scheduled_time
            out.num_cached_tokens = max(request.num_cached_tokens, 0)
        out.token_ids.append(token_id)
        out.new_token_ids.append(token_id)
        if logprob is not None:
            out.logprobs.append(TokenLogprob(token_id, logprob[0], logprob[1]))
        return detok.update(token_id)

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

    def _finish_output(self, request: Request) -> RequestOutput:
        """The final output. At a hand-off, text the detokenizer holds back (a partial
        character, a possible stop string) stays held: the decode worker's detokenizer
        replays the tokens and emits it there."""
        out = self._outputs.pop(request.req_id)
        detok = self._detokenizers.pop(request.req_id)
        if self.proposer is not None:
            self.proposer.finish(request.req_id)
        handoff = request.status == RequestStatus.FINISHED_HANDOFF
        if request.status != RequestStatus.FINISHED_ABORTED:
            out.new_text = detok.take_delta(finished=not handoff)
        else:
            out.new_token_ids, out.new_text = [], ""
        out.text = detok.emitted_text if handoff else detok.output_text
        out.finish_reason = request.finish_reason
        out.stop_reason = request.stop_reason
        out.finished_time = time.monotonic()
        return out

    def _export_kv(self, request: Request) -> KVPayload:
        """The KV of every computed token (the prompt; the token just sampled has none yet)."""
        bs, num_tokens = self.config.cache.block_size, request.num_computed_tokens
        block_ids = self.kv_manager.get_block_ids(request.req_id)[:-(-num_tokens // bs)]
        return KVPayload(num_tokens, self.runner.export_blocks(block_ids),
                         list(self.kv_manager.block_hashes(request, num_tokens // bs)))

    # ---- introspection ---------------------------------------------------------------
    def num_local_prefix_blocks(self, block_hashes: list[bytes]) -> int:
        return len(self.kv_manager.find_longest_cache_hit(block_hashes))

    def take_kv_events(self) -> KVEvents:
        """The prefix cache's stored/removed block hashes since the last call (see
        engine/core/kv_events.py); a worker publishes them to routers between steps."""
        return self.kv_manager.pool.take_kv_events()

    def stats(self) -> EngineStats:
        scheduler, kv = self.scheduler, self.kv_manager
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + (self._structured.num_pending if self._structured else 0),
            num_queued_prefill_tokens=scheduler.num_queued_prefill_tokens(),
            num_free_kv_blocks=kv.num_free_blocks, num_total_kv_blocks=kv.pool.num_blocks,
            num_preemptions=scheduler.num_preemptions, num_prefix_queried_tokens=kv.num_queried_tokens,
            num_prefix_hit_tokens=kv.num_hit_tokens,
            prefill_tokens_per_s=self.step_rates.prefill_tokens_per_s,
            decode_step_ms=self.step_rates.decode_step_s * 1000,
            num_spec_proposed_tokens=self._spec_counts["proposed"],
            num_spec_accepted_tokens=self._spec_counts["accepted"],
            num_spec_verifications=self._spec_counts["verifications"])
