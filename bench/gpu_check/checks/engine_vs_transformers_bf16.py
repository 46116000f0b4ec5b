"""engine_vs_transformers_bf16: the engine (bfloat16, triton backend) greedy against
transformers (bfloat16) on the same GPU: tokens, and logprobs against float32."""
from __future__ import annotations

from bench.gpu_check.context import Ctx, free, make_llm
from bench.gpu_check.greedy import TOP_N, agreement_text, compare_greedy, greedy_with_logprobs

LOGPROB_SLACK = 0.05      # engine |dlogprob| vs float32 may exceed transformers bf16's by 3x + this


def hf_model(ctx: Ctx, dtype):
    """transformers' model of ctx.model on ctx's device."""
    from bench.hf_greedy import load_reference
    from pdserve.engine.model.source import resolve_model
    return load_reference(resolve_model(ctx.model).path, dtype, ctx.device)


def hf_greedy_with_top(model, prompts, max_new_tokens: int, device: str):
    """transformers' greedy tokens and each step's top-N set."""
    from bench.hf_greedy import greedy_with_logits
    tokens, logits = greedy_with_logits(model, prompts, max_new_tokens, device)
    return tokens, [[set(step.topk(TOP_N).indices.tolist()) for step in steps] for steps in logits]


def hf_teacher_forced_logprobs(model, prompts, continuations, device: str) -> list[list[float]]:
    """The logprob transformers gives each continuation token, all in one forward pass."""
    import torch
    out = []
    with torch.inference_mode():
        for ids, cont in zip(prompts, continuations):
            logits = model(torch.tensor([ids + cont[:-1]], device=device)).logits[0, len(ids) - 1:].float()
            lp = logits.log_softmax(-1).gather(1, torch.tensor(cont, device=device)[:, None])[:, 0]
            out.append(lp.tolist())
    return out


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max((abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)), default=0.0)


def run(ctx: Ctx):
    """The engine (bfloat16) greedy against transformers (bfloat16) on the same device: prompts of
    7-400 tokens (two sharing a prefix), 32 tokens each. PASS: (1) every prompt's tokens equal
    up to its first divergence, a near tie; (2) the engine's logprobs of its tokens (transformers
    float32, teacher-forced, as the yardstick) are within 3x + 0.05 of transformers bf16's own
    distance from float32."""
    import torch

    from tests.engine.correctness import varied_prompts
    from pdserve.engine.model.loader import read_arch
    from pdserve.engine.model.source import resolve_model
    vocab = read_arch(resolve_model(ctx.model)).vocab_size
    prompts = varied_prompts(vocab, [7, 16, 33, 64, 129, 257, 400] if ctx.cuda else [7, 33], seed=0)
    new_tokens = 32 if ctx.cuda else 8
    llm = make_llm(ctx)
    e_tokens, e_tops, e_lp = greedy_with_logprobs(llm, prompts, new_tokens)
    del llm
    free()
    hf16 = hf_model(ctx, torch.bfloat16)
    h_tokens, h_tops = hf_greedy_with_top(hf16, prompts, new_tokens, ctx.device)
    h16_lp = hf_teacher_forced_logprobs(hf16, prompts, e_tokens, ctx.device)
    del hf16
    free()
    hf32 = hf_model(ctx, torch.float32)
    h32_lp = hf_teacher_forced_logprobs(hf32, prompts, e_tokens, ctx.device)
    del hf32
    free()
    c = compare_greedy(h_tokens, h_tops, e_tokens, e_tops)
    d_engine, d_hf = max_abs_diff(e_lp, h32_lp), max_abs_diff(h16_lp, h32_lp)
    limit = 3 * d_hf + LOGPROB_SLACK
    ok = not c["not_near_ties"] and d_engine <= limit
    detail = (f"{agreement_text(c, f'prompts x {new_tokens} tokens')}; every prompt agreed on its first "
              f"{c['agreed_prefix']} tokens; max |logprob - fp32 transformers|: engine {d_engine:.3f}, "
              f"transformers bf16 {d_hf:.3f} (limit {limit:.3f})")
    return ("PASS" if ok else "FAIL"), detail, {**c, "logprob_diff_engine": d_engine, "logprob_diff_hf_bf16": d_hf,
                                                "engine_tokens": e_tokens, "hf_tokens": h_tokens}
