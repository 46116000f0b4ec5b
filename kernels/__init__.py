"""Attention and KV-cache kernels: each Triton kernel beside its plain torch reference.

The references are what the engine's `torch` attention backend runs; the Triton kernels
are what its `triton` backend runs on a GPU; kernels/cpu holds the C++ CPU kernels of its
default `cpu` backend. Cache layout, per layer:
key_cache / value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
"""
