"""pdserve's inference engine: paged KV cache, continuous batching, prefix caching."""
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine_core import EngineCore
from engine.errors import InvalidRequestError, ModelLoadError
from engine.llm import LLM
from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams


from engine.model.describe import ModelDescription, describe_model  # noqa: E402


def load_tokenizer(model: str):
    """The tokenizer (with chat template) of a model path or alias, without its weights."""
    from engine.model.loader import load_tokenizer as _load
    from engine.model.source import resolve_model
    return _load(resolve_model(model))

__all__ = ["LLM", "SamplingParams", "RequestOutput", "TokenLogprob", "EngineCore", "EngineConfig",
           "CacheConfig", "SchedulerConfig", "InvalidRequestError", "ModelLoadError", "load_tokenizer",
           "describe_model", "ModelDescription"]
