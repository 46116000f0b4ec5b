"""Greedy reference outputs from Hugging Face transformers, one prompt at a time (no padding)."""
from __future__ import annotations

import os

import torch


def reference_attention(path: str) -> dict:
    """from_pretrained's attention choice for a reference run: eager for a model with
    attention soft-capping. transformers' SDPA and flash paths drop `attn_logit_softcapping`
    without a word, and some releases pick SDPA for Gemma 2 on CUDA (5.17 did on an H200,
    where the reference then disagreed with the engine by 0.45 in logprob); the reference
    must compute what the checkpoint says."""
    from transformers import AutoConfig
    if path.endswith(".gguf"):
        return {}
    config = AutoConfig.from_pretrained(path)
    config = getattr(config, "text_config", None) or config
    return {"attn_implementation": "eager"} if getattr(config, "attn_logit_softcapping", None) else {}


def load_hf_model(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM
    if path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **reference_attention(path)).eval()


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos_token_ids) -> list[list[int]]:
    outs = []
    for ids in prompts:
        seq = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(eos_token_ids),
                             pad_token_id=sorted(eos_token_ids)[0])
        outs.append(seq[0, len(ids):].tolist())
    return outs
