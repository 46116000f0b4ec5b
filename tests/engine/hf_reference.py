"""Greedy reference outputs from Hugging Face transformers, one prompt at a time (no padding)."""
from __future__ import annotations

import os

import torch


def load_hf_model(path: str):
    from transformers import AutoModelForCausalLM
    if path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos_token_ids) -> list[list[int]]:
    outs = []
    for ids in prompts:
        seq = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(eos_token_ids),
                             pad_token_id=sorted(eos_token_ids)[0])
        outs.append(seq[0, len(ids):].tolist())
    return outs
