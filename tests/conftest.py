"""Shared fixtures. Tests run on CPU: Triton kernels run in its interpreter, which must be
chosen before any kernel module is imported."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.models import build_tiny_llama, smollm2_gguf_path  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A tiny random Llama with GQA, saved as a Hugging Face folder (safetensors + tokenizer)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny(tiny_llama_dir):
    """The tiny Llama loaded once per session: in-process workers only read its weights."""
    import torch

    from pdserve.engine.model.loader import load_model
    from pdserve.engine.model.source import resolve_model
    return load_model(resolve_model(tiny_llama_dir), torch.float32, "cpu", progress=False)


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_path):
    """SmolLM2's weights loaded once per session (engines over it only read them)."""
    import torch

    from pdserve.engine.model.loader import load_model
    from pdserve.engine.model.source import resolve_model
    return load_model(resolve_model("smollm2"), torch.float32, "cpu", progress=False)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    return smollm2_gguf_path()
