"""Attention and KV-cache kernels: each Triton kernel beside its plain torch reference.

The references are what the engine's CPU (`torch`) attention backend runs; the Triton
kernels are what its `triton` backend runs on a GPU. Cache layout, per layer:
key_cache / value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
"""
