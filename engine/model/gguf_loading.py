"""Which of a GGUF file's weights stay in their blocks (`--quantization gguf`), and the
GGUF layers (gguf_linear.py) put in place of the full-precision ones before loading.

Kept: the token embedding, the LM head and each layer's projections, where the file stores
them in a type the kernels read (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K). The fused
projections (q/k/v, gate/up) are kept only when all their parts share one type; anything else
(other K-quants, mixed parts, norms) is dequantized to the model's dtype as before, and the
loader says how many were.
"""
from __future__ import annotations

import torch

from pdserve.engine.model.decoder import DecoderForCausalLM
from pdserve.engine.model.gguf_linear import KEPT_TYPES, GGUFEmbedding, GGUFLinear

EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
# our fused layer (parent, attribute) -> the Hugging Face modules it holds
_FUSED = {("attn", "qkv_proj"): ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          ("attn", "o_proj"): ("self_attn.o_proj",),
          ("mlp", "gate_up_proj"): ("mlp.gate_proj", "mlp.up_proj"),
          ("mlp", "down_proj"): ("mlp.down_proj",)}


def kept_gguf_tensors(types: dict[str, int], num_layers: int) -> dict[str, int]:
    """Hugging Face weight name -> ggml type, for the weights kept in their blocks."""
    readable = set(KEPT_TYPES.values())
    kept = {name: types[name] for name in (EMBEDDING, LM_HEAD) if types.get(name) in readable}
    for layer in range(num_layers):
        for parts in _FUSED.values():
            names = [f"model.layers.{layer}.{part}.weight" for part in parts]
            found = {types.get(name) for name in names}
            if len(found) == 1 and found <= readable:
                kept.update(dict.fromkeys(names, found.pop()))
    return kept


def use_gguf_modules(model: DecoderForCausalLM, kept: dict[str, int]) -> None:
    """On the meta model (nothing allocated yet): this stage's kept weights' layers as GGUF ones."""
    start = model.shard.layers.start
    for layer in model.shard.layers:
        for (parent_name, attr), parts in _FUSED.items():
            ggml_type = kept.get(f"model.layers.{layer}.{parts[0]}.weight")
            if ggml_type is None:
                continue
            parent = getattr(model.layers[layer - start], parent_name)
            linear = getattr(parent, attr)
            with torch.device(linear.weight.device):
                setattr(parent, attr, GGUFLinear(linear.in_features, linear.out_features, linear.bias is not None,
                                                 ggml_type))
    embedding_type = kept.get(EMBEDDING)
    if model.embed_tokens is not None and embedding_type is not None:
        table = model.embed_tokens
        with torch.device(table.weight.device):
            model.embed_tokens = GGUFEmbedding(table.num_embeddings, table.embedding_dim, embedding_type)
    # a split model's own head: from the file's output.weight, or from the embedding it is tied to
    head_type = kept.get(EMBEDDING if model.cfg.tie_word_embeddings else LM_HEAD)
    if model.lm_head is not None and head_type is not None:
        head = model.lm_head
        with torch.device(head.weight.device):
            model.lm_head = GGUFLinear(head.in_features, head.out_features, False, head_type)


def finish_gguf_modules(model: DecoderForCausalLM, dtype: torch.dtype) -> None:
    """After the model is allocated and cast: embeddings give `dtype`, and a whole model's
    head tied to a GGUF embedding multiplies by its blocks (shared, not copied)."""
    if isinstance(model.embed_tokens, GGUFEmbedding):
        model.embed_tokens.dtype = dtype
        if model.lm_head is None and model.shard.is_last_stage:
            model.lm_head = GGUFLinear.sharing(model.embed_tokens)
