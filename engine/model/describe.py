"""A model's identity and limits from its headers alone, without loading weights."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pdserve.engine.errors import ModelLoadError
from pdserve.engine.model.arch import arch_from_gguf_metadata, arch_from_hf_config
from pdserve.engine.model.source import resolve_model
from pdserve.engine.model.weights import gguf_metadata, open_gguf


@dataclass(frozen=True)
class ModelDescription:
    model_id: str
    max_position_embeddings: int
    vocab_size: int


def describe_model(model: str, revision: str | None = None) -> ModelDescription:
    source = resolve_model(model, revision)
    if source.kind == "gguf":
        reader = open_gguf(source.path)
        arch = arch_from_gguf_metadata(gguf_metadata(reader), {t.name for t in reader.tensors}, source.path)
    else:
        path = os.path.join(source.path, "config.json")
        try:
            with open(path) as f:
                arch = arch_from_hf_config(json.load(f), path)
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(path, f"cannot read the model config ({e})") from None
    return ModelDescription(source.model_id, arch.max_position_embeddings, arch.vocab_size)
