"""Picks the attention backend an engine was configured with.

Apart from the contract (backend.py) so that the implementations, which import the
contract, are never imported by it: each loads only when chosen (Triton's, for one,
needs Triton).
"""
from __future__ import annotations

from pdserve.engine.attention.backend import AttentionBackend


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "cpu":
        from pdserve.engine.attention.cpu_backend import CpuAttentionBackend
        return CpuAttentionBackend()
    if name == "torch":
        from pdserve.engine.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "triton":
        from pdserve.engine.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    raise ValueError(f"attention_backend: unknown backend {name!r} (choose 'cpu', 'torch' or 'triton')")
