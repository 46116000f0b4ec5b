"""Frozen configuration dataclasses, one per component; the LLM API and the CLI build them."""
from __future__ import annotations

from pdserve.engine.executor.config import ParallelConfig
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.structured.params import DEFAULT_COMPILE_TIMEOUT_S

from dataclasses import dataclass, field

QUANTIZATION_METHODS = ("fp8", "gguf")  # values of --quantization / LLM(quantization=...)

# the embedded default model (engine/model/source.py resolves the alias)
DEFAULT_MODEL = "smollm2"
# SchedulerConfig.scheduling_policy's choices (engine/core/prefill_order.py)
SCHEDULING_POLICIES = ("fcfs", "srpt")


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
    # Per layer, the attention window: None attends the whole context, W the last W
    # positions (the query's own included). Empty: every layer attends the whole context.
    layer_windows: tuple[int | None, ...] = ()
    qk_norm: bool = False                        # Qwen3, Gemma 3: RMSNorm of each head's q and k
    gemma_norms: bool = False                    # (1 + w) norms, sandwich norms, embedding x sqrt(hidden)
    hidden_act: str = "silu"                     # or "gelu_pytorch_tanh" (Gemma)
    attn_logit_softcap: float | None = None      # Gemma 2: scores = cap * tanh(scores / cap)
    final_logit_softcap: float | None = None     # Gemma 2: the same on the LM head's logits
    query_pre_attn_scalar: float | None = None   # Gemma: scale = this ** -0.5 instead of head_dim ** -0.5
    local_rope_theta: float | None = None        # Gemma 3: windowed layers' RoPE base (unscaled)
    num_experts: int = 0                         # mixture of experts (Mixtral, Qwen3-MoE); 0: dense MLP
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True                  # renormalise the top-k router weights to sum to 1
    partial_rotary_factor: float = 1.0           # RoPE on the first head_dim * this dims of a head

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def max_window(self) -> int | None:
        """The widest window when every layer has one; None when some layer sees everything."""
        if not self.layer_windows or any(w is None for w in self.layer_windows):
            return None
        return max(self.layer_windows)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Exact bytes for the KV pool; when None, on CUDA what `gpu_memory_utilization` leaves
    # (engine/worker/memory_profile.py), on the CPU `kv_cache_memory_fraction` of free memory.
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.1
    # vLLM's: the share of the whole device this engine may use, weights and activations
    # included; the KV cache gets the rest of it. CUDA only (the CPU ignores it).
    gpu_memory_utilization: float = 0.9
    # Host memory for blocks the KV cache evicts, brought back on a prefix hit (the host
    # tier, engine/core/host_tier.py; vLLM's --kv-offloading-size, here in bytes): the
    # total over all ranks. 0 or None: off. Needs prefix caching.
    kv_offloading_bytes: int | None = None
    # The platform's key for block names (services/worker/kv_seal.py): block hashes chain
    # from the model's fingerprint under it, so they cannot be computed without it. Empty:
    # from the fingerprint itself (an engine of its own, or a platform without a token).
    block_names_key: bytes = field(default=b"", repr=False)

    def __post_init__(self):
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {u!r}")
        b = self.kv_offloading_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 0):
            raise ValueError(f"kv_offloading_bytes: must be a number of bytes >= 0 (0 or None: off), got {b!r}")
        if b and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_bytes: the host tier keeps blocks the prefix cache evicts, so it "
                             "needs enable_prefix_caching (turn prefix caching on, or offloading off)")


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
    # The order of a step's prefill work (engine/core/prefill_order.py): "fcfs", vLLM's
    # (running first, then waiting by priority and arrival), or "srpt" (decodes first, then
    # every prefill, running or waiting, by priority and then by aged remaining tokens).
    scheduling_policy: str = "fcfs"
    # A step's time bound: its prompt tokens are at most what the measured prefill rate
    # (engine/step_rates.py) computes in this time beside the step's decodes, never fewer
    # than one block (Scheduler._step_budget). 0: token budgets only (the engine's default;
    # pdserve prefill's is 150, --role both's 100). Needs chunked prefill; until a rate is measured, the token
    # budgets alone apply.
    max_step_ms: float = 0.0

    def __post_init__(self):
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy: must be 'fcfs' or 'srpt', got {self.scheduling_policy!r}")
        ms = self.max_step_ms
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 <= ms < float("inf"):
            raise ValueError(f"max_step_ms: must be a number of milliseconds >= 0 (0: no time bound), got {ms!r}")
        if ms and not self.enable_chunked_prefill:
            raise ValueError("max_step_ms: bounding a step in time splits prompts, so it needs chunked prefill "
                             "(turn chunked prefill on, or max_step_ms off with 0)")


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
    # `model` named org/name from the Hugging Face cache: its branch, tag or commit (None: main)
    revision: str | None = None
    # vLLM's --quantization: None takes the checkpoint as saved (a GGUF file dequantized); "gguf" keeps
    # a GGUF file's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K weights in their blocks; "fp8" asks for an fp8 checkpoint
    quantization: str | None = None

    def __post_init__(self):
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(f"quantization: must be one of {list(QUANTIZATION_METHODS)} or unset (None: the "
                             f"checkpoint as saved), got {self.quantization!r}")
        sizes = self.cuda_graph_batch_sizes
        if not isinstance(sizes, tuple) or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"cuda_graph_batch_sizes: must be a tuple of positive batch sizes, got {sizes!r}")
        if sizes and (self.device.split(":")[0] != "cuda" or self.attention_backend != "triton"):
            raise ValueError(f"cuda_graph_batch_sizes: CUDA graphs need device 'cuda' and attention_backend "
                             f"'triton' (got device {self.device!r}, attention_backend "
                             f"{self.attention_backend!r}); leave it empty to run every step eagerly")
