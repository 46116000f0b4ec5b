"""EngineCore: the step loop. schedule -> execute (one flat batch) -> sample -> update."""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from engine.attention.backend import get_attention_backend
from engine.config import EngineConfig, SchedulerConfig
from engine.core.block_hash import hash_full_blocks, model_fingerprint
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.detokenizer import IncrementalDetokenizer
from engine.model.loader import LoadedModel, load_model, parse_dtype
from engine.model.source import resolve_model
from engine.outputs import RequestOutput, TokenLogprob
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.kv_transfer import KVPayload
from engine.validation import validate_request, validate_transfer
from engine.worker.kv_cache import allocate_kv_caches, num_kv_blocks
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, progress: bool = True, loaded: LoadedModel | None = None):
        """`loaded`: weights already in memory (several engines over one model, as in tests)."""
        self.config = config
        self.source = resolve_model(config.model)
        self.dtype = parse_dtype(config.dtype)
        device = torch.device(config.device)
        backend = get_attention_backend(config.attention_backend)
        self.loaded = loaded or load_model(self.source, self.dtype, config.device,
                                           config.scheduler.max_model_len, progress)
        self.tokenizer = self.loaded.tokenizer
        arch, cache = self.loaded.arch, config.cache
        num_blocks = num_kv_blocks(cache, arch, self.dtype, device)
        self.max_model_len = self._resolve_max_model_len(num_blocks)
        self.root_hash = model_fingerprint(self.source.model_id, str(self.dtype), arch.num_layers,
                                           arch.num_kv_heads, arch.head_dim, cache.block_size)
        self.kv_manager = KVCacheManager(num_blocks, cache.block_size, self.root_hash,
                                         cache.enable_prefix_caching)
        self.scheduler = Scheduler(self._resolve_scheduler_config(), self.kv_manager)
        kv_caches = allocate_kv_caches(num_blocks, arch, cache.block_size, self.dtype, device)
        self.runner = ModelRunner(self.loaded.model, kv_caches, cache.block_size, backend, device, config.seed)
        self._outputs: dict[str, RequestOutput] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._aborted: list[RequestOutput] = []

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
                    prompt: str | None = None, *, output_token_ids: list[int] = (),
                    kv_import: KVPayload | None = None, export_kv: bool = False, priority: int = 0) -> None:
        """Validate and queue a request; a bad one raises InvalidRequestError and changes nothing.

        Disaggregated serving: a prefill worker sets `export_kv` (the final output carries
        the prompt's KV) and may pass a cached prefix as `kv_import`; a decode worker passes
        the first token as `output_token_ids` and the prompt's KV as `kv_import`.
        """
        validate_request(req_id, prompt_token_ids, params, self.max_model_len,
                         self.loaded.arch.vocab_size, self._outputs)
        validate_transfer(prompt_token_ids, output_token_ids, kv_import, self.kv_block_shape,
                          self.loaded.arch.vocab_size)
        request = Request(req_id, prompt_token_ids, params, self.loaded.eos_token_ids,
                          output_token_ids=output_token_ids, kv_import=kv_import, export_kv=export_kv,
                          priority=priority)
        # the output covers the whole completion, tokens produced elsewhere included
        out = RequestOutput(req_id, prompt, list(prompt_token_ids), token_ids=list(output_token_ids),
                            logprobs=[] if params.logprobs is not None else None, arrival_time=time.monotonic())
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.stop,
                                       params.include_stop_str_in_output)
        for token_id in output_token_ids:  # already streamed by whoever produced them
            detok.update(token_id)
            detok.take_delta(finished=False)
        self._outputs[req_id], self._detokenizers[req_id] = out, detok
        self.scheduler.add_request(request)

    @property
    def kv_block_shape(self) -> tuple[int, ...]:
        """One block of a KVPayload: [num_layers, 2, block_size, num_kv_heads, head_dim]."""
        arch = self.loaded.arch
        return (arch.num_layers, 2, self.config.cache.block_size, arch.num_kv_heads, arch.head_dim)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The checks of add_request, without queueing anything."""
        validate_request("validate", prompt_token_ids, params, self.max_model_len,
                         self.loaded.arch.vocab_size, ())

    def abort_request(self, req_id: str) -> None:
        """Stop a request and free its blocks; its final output comes with the next step."""
        for request in self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED):
            self._aborted.append(self._finish_output(request))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._aborted)

    # ---- the loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns the outputs of requests that advanced or ended."""
        outputs, self._aborted = self._aborted, []
        sched = self.scheduler.schedule()
        if sched.is_empty and not sched.finished_req_ids:
            return outputs
        result = self.runner.execute_model(sched)
        for request in self.scheduler.update_from_output(sched, result):
            outputs.append(self._process_token(request, result.logprobs.get(request.req_id)))
        return outputs

    def _process_token(self, request: Request, logprob) -> RequestOutput:
        out = self._outputs[request.req_id]
        token_id = request.all_token_ids[-1]
        now = time.monotonic()
        if out.first_token_time is None:
            out.first_token_time = now
            out.first_scheduled_time = request.first_scheduled_time
            out.num_cached_tokens = max(request.num_cached_tokens, 0)
        out.token_ids.append(token_id)
        out.new_token_ids = [token_id]
        if logprob is not None:
            out.logprobs.append(TokenLogprob(token_id, logprob[0], logprob[1]))
        detok = self._detokenizers[request.req_id]
        matched_stop = detok.update(token_id)
        status = RequestStatus.FINISHED_STOPPED if matched_stop is not None else self.scheduler.check_stop(request)
        if matched_stop is not None:
            request.stop_reason = matched_stop
        if status is None:
            out.text = detok.output_text
            out.new_text = detok.take_delta(finished=False)
            return out
        # A prefill-mode request that ran out of tokens is handed to a decode worker, whose
        # detokenizer replays its tokens: nothing may be flushed that a stream holds back.
        handoff = request.export_kv and status == RequestStatus.FINISHED_LENGTH
        if matched_stop is None and not handoff:
            detok.flush()
        if request.export_kv:
            out.kv_export = self._export_kv(request)
        self.scheduler.finish_requests([request.req_id], status)
        return self._finish_output(request, handoff)

    def _finish_output(self, request: Request, handoff: bool = False) -> RequestOutput:
        out = self._outputs.pop(request.req_id)
        detok = self._detokenizers.pop(request.req_id)
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
    def prompt_block_hashes(self, token_ids: list[int]) -> list[bytes]:
        """The names of a prompt's full blocks, as the kvstore and every engine know them."""
        return hash_full_blocks(self.root_hash, token_ids, self.config.cache.block_size)

    def num_local_prefix_blocks(self, block_hashes: list[bytes]) -> int:
        return len(self.kv_manager.find_longest_cache_hit(block_hashes))

    def stats(self) -> dict[str, float]:
        kv = self.kv_manager
        stats = dict(self.scheduler.stats())
        stats["prefix_cache_queried_tokens"] = kv.num_queried_tokens
        stats["prefix_cache_hit_tokens"] = kv.num_hit_tokens
        stats["num_queued_prefill_tokens"] = self.scheduler.num_queued_prefill_tokens()
        return stats
