"""The choices an engine makes once, at start: its attention backend, its KV cache's memory
(a CUDA engine's profile run), its model's identity in block hashes, its context length, its
scheduler's token budget, and how it drafts tokens (speculative decoding)."""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.selector import get_attention_backend
from pdserve.engine.config import EngineConfig, ModelArchConfig, SchedulerConfig
from pdserve.engine.core.block_hash import BlockHash, keyed_root, model_fingerprint
from pdserve.engine.dtypes import dtype_name
from pdserve.engine.info import EngineInfo
from pdserve.engine.kv_transfer import KVLayout
from pdserve.engine.model.identity import checkpoint_identity
from pdserve.engine.model.loader import LoadedModel, load_model
from pdserve.engine.model.source import ModelSource, resolve_model
from pdserve.engine.spec_decode.drafting import Drafting, NoDrafting
from pdserve.engine.spec_decode.ngram import NgramProposer
from pdserve.engine.worker.kv_cache import bytes_per_block, num_host_kv_slots, num_kv_blocks

if TYPE_CHECKING:
    from pdserve.engine.executor.base import Executor
    from pdserve.engine.worker.memory_profile import MemoryProfile

logger = logging.getLogger(__name__)


def pick_attention_backend(config: EngineConfig) -> AttentionBackend:
    if config.attention_backend == "cpu" and torch.device(config.device).type != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on the CPU only; on device {config.device!r} "
                         "use 'triton' (or 'torch', the pure torch reference)")
    return get_attention_backend(config.attention_backend)


def model_naming(source: ModelSource, dtype: torch.dtype, arch: ModelArchConfig, block_size: int,
                 names_key: bytes = b"", quantization: str | None = None) -> tuple[str, BlockHash]:
    """The model's key (its files' digest, never its path: two folders of one name but other
    weights must not share KV; with the quantization it is loaded in, which changes what it
    computes) and the root of its block hashes, built on that key (and on the platform's
    `names_key`, when it has one)."""
    key = checkpoint_identity(source) + (f"+{quantization}" if quantization else "")
    fingerprint = model_fingerprint(key, str(dtype), arch.num_layers, arch.num_kv_heads, arch.head_dim, block_size)
    return key, keyed_root(fingerprint, names_key)


def engine_info(config: EngineConfig, model_id: str, arch: ModelArchConfig, dtype: torch.dtype, max_model_len: int,
                max_num_seqs: int, root_hash: bytes) -> EngineInfo:
    bs = config.cache.block_size
    block_shape = (arch.num_layers, 2, bs, arch.num_kv_heads, arch.head_dim)
    return EngineInfo(bs, max_model_len, arch.vocab_size, max_num_seqs, root_hash, block_shape,
                      KVLayout.of(model_id, dtype_name(dtype), block_shape))


def memory_profile(config: EngineConfig, executor: Executor, backend: AttentionBackend, dtype: torch.dtype,
                   device: torch.device) -> MemoryProfile | None:
    """A single-rank CUDA engine without kv_cache_memory_bytes measures its memory with one
    dummy step (engine/worker/memory_profile.py), for gpu_memory_utilization to size the KV
    cache by. None elsewhere: the CPU sizes it as before, at no cost."""
    if device.type != "cuda" or config.cache.kv_cache_memory_bytes is not None:
        return None
    if config.parallel.world_size > 1:  # the dummy step would have to run on every rank
        logger.warning("gpu_memory_utilization is not applied to tensor/pipeline-parallel engines yet: each "
                       "rank's KV cache is kv_cache_memory_fraction (%g) of its free memory",
                       config.cache.kv_cache_memory_fraction)
        return None
    from pdserve.engine.worker.memory_profile import describe, profile_memory
    sched, arch = config.scheduler, executor.loaded.arch
    max_seq_len = sched.max_model_len or arch.max_position_embeddings  # what the model's RoPE tables hold
    num_tokens = sched.max_num_batched_tokens or max_seq_len  # resolve_scheduler_config's budget
    profile = profile_memory(executor.loaded.model, backend, executor.kv_arch, config.cache.block_size, dtype,
                             device, num_tokens, max_seq_len, sched.max_num_seqs)
    logger.info("%s", describe(profile, config.cache.gpu_memory_utilization))
    return profile


def log_kv_cache(num_blocks: int, block_size: int, block_bytes: int, max_model_len: int, num_ranks: int) -> None:
    """vLLM's start-up line: the pool's size and how many longest requests it holds at once."""
    num_tokens = num_blocks * block_size
    logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB%s); maximum concurrency for %d tokens "
                "per request: %.2fx", num_blocks, block_size, num_tokens, num_blocks * block_bytes / (1 << 30),
                " per rank" if num_ranks > 1 else "", max_model_len, num_tokens / max_model_len)


def resolve_max_model_len(config: EngineConfig, loaded: LoadedModel, num_blocks: int) -> int:
    wanted = config.scheduler.max_model_len or loaded.arch.max_position_embeddings
    capacity = num_blocks * config.cache.block_size
    if wanted > capacity:
        logger.warning("max_model_len lowered from %d to %d tokens: the KV cache holds %d blocks",
                       wanted, capacity, num_blocks)
    return min(wanted, capacity)


@dataclasses.dataclass(frozen=True)
class KVCacheSize:
    num_blocks: int       # device blocks per rank
    num_host_slots: int   # the host tier's blocks (0: no tier)
    max_model_len: int    # the context, capped by what the blocks hold


def size_kv_cache(config: EngineConfig, executor: Executor, loaded: LoadedModel, backend: AttentionBackend,
                  dtype: torch.dtype, device: torch.device) -> KVCacheSize:
    """How many KV blocks each rank gets (memory left after profiling a step on a GPU, the
    configured budget on the CPU), logged; a rank holds its layers and KV heads only."""
    cache, kv_arch, num_ranks = config.cache, executor.kv_arch, config.parallel.world_size
    profile = memory_profile(config, executor, backend, dtype, device)  # None on the CPU
    num_blocks = num_kv_blocks(cache, kv_arch, dtype, device, num_ranks, profile)
    max_model_len = resolve_max_model_len(config, loaded, num_blocks)
    log_kv_cache(num_blocks, cache.block_size, bytes_per_block(kv_arch, cache.block_size, dtype), max_model_len,
                 num_ranks)
    return KVCacheSize(num_blocks, num_host_kv_slots(cache, kv_arch, dtype, num_ranks), max_model_len)


def resolve_scheduler_config(config: SchedulerConfig, max_model_len: int) -> SchedulerConfig:
    budget = config.max_num_batched_tokens or max_model_len
    # Unsplit, a prompt longer than the budget could never be scheduled (vLLM's rule).
    if not config.enable_chunked_prefill and budget < max_model_len:
        raise ValueError(f"max_num_batched_tokens: {budget} is smaller than max_model_len "
                         f"({max_model_len}); with chunked prefill off it must be at least "
                         "max_model_len, or lower max_model_len")
    return dataclasses.replace(config, max_num_batched_tokens=budget, max_model_len=max_model_len)


def make_drafting(config: EngineConfig, target_path: str, loaded: LoadedModel, reusable: bool,
                  dtype: torch.dtype, num_blocks: int, max_model_len: int) -> Drafting:
    """`reusable`: `loaded` is the whole target model, which a draft of the same files
    (`target_path`: the target's folder or .gguf file) shares."""
    spec = config.speculative_config
    if spec is None:
        return NoDrafting()
    if spec.method == "ngram":
        proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        return Drafting.of(spec, proposer, max_model_len)
    from pdserve.engine.spec_decode.draft_model import DraftModelProposer, check_same_tokenizer
    source = resolve_model(spec.model)
    draft = loaded if source.path == target_path and reusable else load_model(
        source, dtype, config.device, max_model_len, progress=False)
    check_same_tokenizer(loaded.tokenizer, draft.tokenizer)
    bs = config.cache.block_size
    # room for as many tokens as the target's cache holds
    proposer = DraftModelProposer(draft, spec.num_speculative_tokens, config.device, dtype,
                                  num_blocks * bytes_per_block(draft.arch, bs, dtype), bs, config.attention_backend,
                                  vocab_limit=len(loaded.tokenizer), max_model_len=max_model_len)
    return Drafting.of(spec, proposer, max_model_len)
