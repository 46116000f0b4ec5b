"""pdserve's inference engine: paged KV cache, continuous batching, prefix caching.

The public names load on first use (PEP 562): `import pdserve.engine.core.scheduler` or
`pdserve.engine.sampling_params` must not pull in torch and the model code, which the router and
the kvstore never need. `from pdserve.engine import LLM` still works and loads only what LLM needs.
"""
from __future__ import annotations

import importlib

_SUBMODULES = {
    "CacheConfig": "pdserve.engine.config", "EngineConfig": "pdserve.engine.config", "SchedulerConfig": "pdserve.engine.config",
    "EngineCore": "pdserve.engine.engine_core", "EngineRequest": "pdserve.engine.engine_request",
    "InvalidRequestError": "pdserve.engine.errors", "ModelLoadError": "pdserve.engine.errors",
    "LLM": "pdserve.engine.llm",
    "RequestOutput": "pdserve.engine.outputs", "TokenLogprob": "pdserve.engine.outputs", "Logprob": "pdserve.engine.outputs",
    "SamplingParams": "pdserve.engine.sampling_params",
    "RequestMode": "pdserve.engine.request", "EngineStats": "pdserve.engine.stats", "EngineInfo": "pdserve.engine.info",
    "ModelDescription": "pdserve.engine.model.describe", "describe_model": "pdserve.engine.model.describe",
}

__all__ = ["LLM", "SamplingParams", "RequestOutput", "TokenLogprob", "Logprob", "EngineCore", "EngineConfig",
           "CacheConfig", "SchedulerConfig", "InvalidRequestError", "ModelLoadError", "load_tokenizer",
           "describe_model", "ModelDescription", "RequestMode", "EngineStats", "EngineInfo", "EngineRequest"]


def load_tokenizer(model: str, revision: str | None = None):
    """The tokenizer (with chat template) of a model path, alias or cached org/name, without its weights."""
    from pdserve.engine.model.loader import load_tokenizer as _load
    from pdserve.engine.model.source import resolve_model
    return _load(resolve_model(model, revision))


def __getattr__(name: str):
    if name not in _SUBMODULES:
        raise AttributeError(f"module 'pdserve.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_SUBMODULES[name]), name)
    globals()[name] = value  # cached: the next lookup does not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
