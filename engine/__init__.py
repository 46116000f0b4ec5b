"""pdserve's inference engine: paged KV cache, continuous batching, prefix caching."""
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.errors import InvalidRequestError, ModelLoadError
from engine.llm import LLM
from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "TokenLogprob", "EngineCore", "EngineConfig",
           "CacheConfig", "SchedulerConfig", "InvalidRequestError", "ModelLoadError"]
