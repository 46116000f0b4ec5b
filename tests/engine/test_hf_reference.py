"""The transformers reference computes what the checkpoint says: a model with attention
soft-capping runs eager attention, since SDPA and flash attention drop the cap silently."""
from __future__ import annotations

import pytest

from bench.tiny_checkpoints import build_tiny_checkpoint
from tests.engine.hf_reference import load_hf_model, reference_attention
from tests.models import smollm2_tokenizer


@pytest.mark.parametrize("arch, expected", [("gemma2", {"attn_implementation": "eager"}), ("mistral", {})])
def test_reference_attention_by_softcap(arch, expected, tmp_path):
    path = build_tiny_checkpoint(arch, tmp_path, smollm2_tokenizer())
    assert reference_attention(path) == expected
    if expected:
        assert load_hf_model(path).config._attn_implementation == "eager"
