"""The offline API: `LLM(model=...).generate(prompts, params)` drives the engine loop."""
from __future__ import annotations

from pdserve.engine.spec_decode.config import SpeculativeConfig

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from pdserve.engine.chat import (DEFAULT_OPTIONS, TemplateOptions, encode_chat_prompt, load_chat_template,
                                 render_chat_prompt, with_chat_template)
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.block_hash import check_cache_salt
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.executor.config import ParallelConfig
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.model.loader import LoadedModel
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.engine_request import EngineRequest

PromptType = str | dict


class LLM:
    # Every default is the config dataclasses' own (engine/config.py): one place per setting.
    def __init__(self, model: str = EngineConfig.model, *, dtype: str = EngineConfig.dtype,
                 device: str = EngineConfig.device, attention_backend: str = EngineConfig.attention_backend,
                 seed: int = EngineConfig.seed, block_size: int = CacheConfig.block_size,
                 enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
                 kv_cache_memory_bytes: int | None = CacheConfig.kv_cache_memory_bytes,
                 kv_cache_memory_fraction: float = CacheConfig.kv_cache_memory_fraction,
                 gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization,
                 kv_offloading_bytes: int | None = CacheConfig.kv_offloading_bytes,
                 max_num_seqs: int = SchedulerConfig.max_num_seqs,
                 max_num_batched_tokens: int | None = SchedulerConfig.max_num_batched_tokens,
                 long_prefill_token_threshold: int = SchedulerConfig.long_prefill_token_threshold,
                 max_model_len: int | None = SchedulerConfig.max_model_len,
                 enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill,
                 scheduling_policy: str = SchedulerConfig.scheduling_policy,
                 max_step_ms: float = SchedulerConfig.max_step_ms,
                 cuda_graph_batch_sizes: Sequence[int] = EngineConfig.cuda_graph_batch_sizes,
                 speculative_config: dict | SpeculativeConfig | None = None,
                 tensor_parallel_size: int = ParallelConfig.tensor_parallel_size,
                 pipeline_parallel_size: int = ParallelConfig.pipeline_parallel_size,
                 pipeline_layer_split: Sequence[int] | None = None,
                 pipeline_microbatches: int | None = ParallelConfig.pipeline_microbatches,
                 collective_timeout_s: float = ParallelConfig.collective_timeout_s,
                 revision: str | None = EngineConfig.revision,
                 quantization: str | None = EngineConfig.quantization,
                 chat_template: str | None = None,
                 progress: bool = True,
                 loaded_model: LoadedModel | None = None):
        """`revision`: of a model named org/name in the Hugging Face cache. `chat_template`: a
        Jinja file or the template itself, in place of the tokenizer's (chat, apply_chat_template).
        `kv_offloading_bytes`: host memory keeping the blocks the KV cache evicts (vLLM's
        kv_offloading_size, in bytes; docs/kv_tiers.md). `quantization`: "gguf" keeps a GGUF
        file's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K weights in their blocks (docs/serving.md)."""
        template = load_chat_template(chat_template) if chat_template is not None else None  # before loading
        config = EngineConfig(
            model=model, revision=revision, quantization=quantization, dtype=dtype, device=device,
            attention_backend=attention_backend,
            seed=seed, cache=CacheConfig(block_size, enable_prefix_caching, kv_cache_memory_bytes,
                                         kv_cache_memory_fraction, gpu_memory_utilization, kv_offloading_bytes),
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, long_prefill_token_threshold,
                                      max_model_len, enable_chunked_prefill, scheduling_policy, max_step_ms),
            cuda_graph_batch_sizes=_as_tuple(cuda_graph_batch_sizes),
            speculative_config=SpeculativeConfig.from_dict(speculative_config),
            parallel=ParallelConfig(
                tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                pipeline_layer_split=None if pipeline_layer_split is None else _as_tuple(pipeline_layer_split),
                pipeline_microbatches=pipeline_microbatches, collective_timeout_s=collective_timeout_s))
        self.engine = EngineCore(config, progress=progress, loaded=loaded_model)
        self.tokenizer = with_chat_template(self.engine.tokenizer, template)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stops the rank processes of a tensor/pipeline-parallel engine (they also stop when
        this process exits); nothing to do for a single-rank one."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One output per prompt, in order. All prompts are validated before any is queued.
        With SamplingParams.n > 1 a prompt's output is its first completion, and `.outputs`
        holds all n in index order (as vLLM's RequestOutput.outputs; `.outputs` is [the
        output] for n = 1; `.other_outputs` the n - 1 after it): the prompt is computed
        once for all of them.
        A dict prompt may carry "cache_salt" (as in vLLM): it shares cached KV only with
        prompts of the same salt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif not isinstance(prompts, Sequence):
            raise InvalidRequestError("prompt", f"must be a string, a dict or a list of them, got "
                                                f"{type(prompts).__name__}")
        params = self._params_per_prompt(sampling_params, len(prompts))
        encoded = [self._encode(p, i) for i, p in enumerate(prompts)]
        salts = [p.get("cache_salt", "") if isinstance(p, dict) else "" for p in prompts]
        return self._run([(text, ids) for text, ids in encoded], params, use_tqdm, salts)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, tools: list[dict] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts, assistant ones may carry
        OpenAI's `tool_calls`) or a list of them; `tools` (OpenAI's form) are rendered by the
        chat template into every prompt, and the other arguments go to the template, as vLLM's
        LLM.chat does (engine.chat.TemplateOptions)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = self._params_per_prompt(sampling_params, len(conversations))
        options = TemplateOptions(add_generation_prompt, continue_final_message, variables=chat_template_kwargs or {})
        encoded = [encode_chat_prompt(self.tokenizer, conversation, tools, options) for conversation in conversations]
        return self._run(encoded, params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            options: TemplateOptions = DEFAULT_OPTIONS) -> str:
        return render_chat_prompt(self.tokenizer, conversation, tools, options)

    def _params_per_prompt(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise InvalidRequestError("sampling_params", f"got {len(params)} for {n} prompts")
        return params

    def _encode(self, prompt: PromptType, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", f"prompt {index} is empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._encode(prompt["prompt"], index)
        raise InvalidRequestError("prompt", f"prompt {index} must be a string or a dict with "
                                            "'prompt' or 'prompt_token_ids'")

    def _run(self, encoded: list[tuple[str | None, list[int]]], params: list[SamplingParams],
             use_tqdm: bool, salts: Sequence[str] = ()) -> list[RequestOutput]:
        engine = self.engine
        req_ids = [f"llm-{next(self._ids)}" for _ in encoded]
        salts = list(salts) or [""] * len(encoded)
        for (_, ids), p, salt in zip(encoded, params, salts):
            engine.validate(ids, p)
            if (problem := check_cache_salt(salt)) is not None:
                raise InvalidRequestError("cache_salt", problem)
            if p.structured_outputs is not None:  # a spec that does not compile is refused before anything runs
                engine.structured.compiler.check(p.structured_outputs)
        for req_id, (text, ids), p, salt in zip(req_ids, encoded, params, salts):
            engine.add_request(EngineRequest(req_id, ids, p, prompt=text, cache_salt=salt))
        # a prompt's n completions (SamplingParams.n) come as n outputs of its req_id, by index
        finished: dict[str, list[RequestOutput | None]] = {r: [None] * p.n for r, p in zip(req_ids, params)}
        num_open = {r: p.n for r, p in zip(req_ids, params)}
        with tqdm(total=len(req_ids), desc="Generating", disable=not use_tqdm) as bar:
            while any(num_open.values()):
                for out in engine.step():
                    if out.finished and out.req_id in finished:
                        finished[out.req_id][out.index] = out
                        num_open[out.req_id] -= 1
                        bar.update(num_open[out.req_id] == 0)
        return [_with_outputs(finished[r]) for r in req_ids]


def _with_outputs(completions: list[RequestOutput]) -> RequestOutput:
    """A prompt's output: its first completion, with all n in `outputs` (vLLM's shape)."""
    first = completions[0]
    first.other_outputs = completions[1:]
    return first


def _as_tuple(value):
    """Lists become tuples (the config is frozen and hashable); anything else is the config's to reject."""
    return tuple(value) if isinstance(value, list) else value
