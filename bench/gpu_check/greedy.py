"""Greedy runs compared as vLLM's check_logprobs_close does: tokens equal up to the first
divergence, and there each side's token among the other's top N (a near tie: rounding)."""
from __future__ import annotations

TOP_N = 5                 # a near tie: each side's token among the other's top 5 (vLLM's rule)


def greedy_with_logprobs(llm, prompts: list[list[int]], max_tokens: list[int] | int):
    """Tokens, top-N sets and the chosen tokens' logprobs of one generate call."""
    from pdserve.engine import SamplingParams
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=TOP_N) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    tokens = [o.token_ids for o in outs]
    tops = [[set(lp.top_logprobs) | {lp.token_id} for lp in o.logprobs] for o in outs]
    logprobs = [[lp.logprob for lp in o.logprobs] for o in outs]
    return tokens, tops, logprobs


def compare_greedy(ref: list[list[int]], ref_top, got: list[list[int]], got_top=None) -> dict:
    """Two greedy runs of the same prompts, token for token. At a first divergence both
    contexts are still equal, so it is rounding only when the two tokens were nearly tied:
    `got`'s token among `ref`'s top N and (when `got_top` is given) the reverse. Later
    tokens follow different contexts and are not compared."""
    exact, divergences, not_ties = 0, [], []
    for i, (r, g) in enumerate(zip(ref, got)):
        d = next((k for k, (a, b) in enumerate(zip(r, g)) if a != b), None)
        if d is None and len(r) == len(g):
            exact += 1
            continue
        if d is None:
            divergences.append(min(len(r), len(g)))
            not_ties.append(f"prompt {i}: {len(g)} tokens, expected {len(r)}")
            continue
        divergences.append(d)
        if g[d] not in ref_top[i][d] or (got_top is not None and r[d] not in got_top[i][d]):
            not_ties.append(f"prompt {i} at token {d}: {g[d]} vs {r[d]}")
    return {"prompts": len(ref), "exact": exact, "divergences": sorted(divergences), "not_near_ties": not_ties,
            "agreed_prefix": min(divergences) if divergences else min(map(len, ref))}


def agreement_text(c: dict, what: str) -> str:
    text = f"exact {c['exact']}/{c['prompts']} {what}"
    if c["divergences"]:
        shown = ",".join(map(str, c["divergences"][:8])) + ("..." if len(c["divergences"]) > 8 else "")
        text += f", first divergence at token {shown}"
        ties = "all near ties" if not c["not_near_ties"] else "NOT near ties: " + "; ".join(c["not_near_ties"][:3])
        text += f" ({ties})"
    return text

