"""transformers as the yardstick the GPU checks hold the engine to (bench/gpu_check/,
bench/gpu_models.py): its model of a checkpoint with every asked-for token kept, and its
greedy run, one prompt at a time (no padding), as tests/engine/hf_reference.py runs it."""
from __future__ import annotations


def load_reference(path: str, dtype, device: str):
    """transformers' model of the checkpoint at `path`, in `dtype`, on `device`."""
    from tests.engine.hf_reference import load_hf_model
    model = load_hf_model(path, dtype)
    model.generation_config.eos_token_id = None  # every asked-for token, as ignore_eos does
    return model.to(device)


def greedy_with_logits(model, prompts: list[list[int]], max_new_tokens: int, device: str):
    """Each prompt's greedy tokens and its steps' logits (float32, [steps, vocab], on the CPU),
    from which a caller takes the top-N sets or the log-softmax it compares with."""
    import torch
    tokens, logits = [], []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids], device=device),
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                                 max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(ids):].tolist())
            logits.append(torch.stack([step[0].float() for step in out.logits]).cpu())
    return tokens, logits
