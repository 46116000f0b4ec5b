"""Frozen configuration dataclasses, one per component; the LLM API and the CLI build them."""
from __future__ import annotations

from engine.executor.config import ParallelConfig
from engine.spec_decode.config import SpeculativeConfig
from engine.structured.params import DEFAULT_COMPILE_TIMEOUT_S

from dataclasses import dataclass, field

# the embedded default model (engine/model/source.py resolves the alias)
DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class ModelArchConfig:
    """The shape of a Llama-family decoder, read from config.json or GGUF metadata."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Exact bytes for the KV pool; when None, `kv_cache_memory_fraction` of free memory.
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.1


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    # None: max_model_len, the smallest budget that holds any prompt unsplit.
    max_num_batched_tokens: int | None = 2048
    # A single prefill takes at most this many tokens of a step (chunked prefill).
    long_prefill_token_threshold: int = 512
    max_model_len: int | None = None  # None: the model's context, capped by the KV pool
    # Off: a prompt's remaining tokens run in one step or wait (vLLM's enable_chunked_prefill).
    enable_chunked_prefill: bool = True


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "cpu"  # the C++ kernels; "torch": the pure torch reference; "triton": GPU
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Decode batch sizes to capture as CUDA graphs at start-up (e.g. (1, 2, 4, 8, 16, 32, 64));
    # empty: every step runs eagerly (vLLM's enforce_eager). CUDA and the triton backend only.
    cuda_graph_batch_sizes: tuple[int, ...] = ()
    # structured outputs: a request whose grammar takes longer to compile ends with an error
    structured_outputs_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    # speculative decoding (engine/spec_decode): None: off
    speculative_config: SpeculativeConfig | None = None
    # tensor and pipeline parallelism: t x p ranks, one process each (engine/executor/)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self):
        sizes = self.cuda_graph_batch_sizes
        if not isinstance(sizes, tuple) or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"cuda_graph_batch_sizes: must be a tuple of positive batch sizes, got {sizes!r}")
        if sizes and (self.device.split(":")[0] != "cuda" or self.attention_backend != "triton"):
            raise ValueError(f"cuda_graph_batch_sizes: CUDA graphs need device 'cuda' and attention_backend "
                             f"'triton' (got device {self.device!r}, attention_backend "
                             f"{self.attention_backend!r}); leave it empty to run every step eagerly")
