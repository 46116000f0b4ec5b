"""Verification of drafts: greedy by hand, the target's distribution preserved (chi-square over
many identical requests in one batch), seeded draws independent of the batch, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.sample.sampler import sample
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec_decode.rejection import num_rows, verify

N = 20_000
# the 1 - 1e-4 quantile of chi-square with `dof` degrees of freedom: a correct sampler fails
# one run in 10,000; the broken variants tried (resampling from p instead of the residual, the
# bonus drawn from the wrong row) score in the hundreds or more
CHI2_LIMIT = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.75}

P1 = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
P2 = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.15, 0.25])


def _generator(seed=0):
    return torch.Generator().manual_seed(seed)


def _assert_distributed_as(tokens: list[int], p: torch.Tensor):
    counts = torch.bincount(torch.tensor(tokens), minlength=len(p)).double()
    expected = p.double() * len(tokens)
    support = p > 0
    assert counts[~support].sum() == 0, f"tokens outside the support: {counts.tolist()}"
    chi2 = (((counts - expected) ** 2)[support] / expected[support]).sum().item()
    assert chi2 < CHI2_LIMIT[int(support.sum()) - 1], f"chi2={chi2:.1f}, counts={counts.tolist()}"


def _batch(rows: list[torch.Tensor], n: int) -> torch.Tensor:
    """n identical requests, each scored at len(rows) positions with these distributions."""
    return torch.stack([r.log() for r in rows]).repeat(n, 1)


def _params(n, **kw):
    return [SamplingParams(temperature=1.0, **kw) for _ in range(n)]


# --- greedy ---------------------------------------------------------------------------------

def _one_hot_logits(argmaxes: list[int], vocab=8) -> torch.Tensor:
    logits = torch.randn(len(argmaxes), vocab, generator=_generator()) * 0.1
    logits[range(len(argmaxes)), argmaxes] = 5.0
    return logits


@pytest.mark.parametrize("drafts, emitted", [
    ([3, 1, 4], [3, 1, 4, 6]),   # all accepted: the bonus is the last row's argmax
    ([3, 1, 5], [3, 1, 4]),      # the third rejected: the target's argmax there instead
    ([2, 1, 4], [3]),            # the first rejected
    ([], [3]),                   # no drafts: a plain step
])
def test_greedy_keeps_drafts_while_they_are_the_argmax(drafts, emitted):
    logits = _one_hot_logits([3, 1, 4, 6][:len(drafts) + 1])
    out = verify(logits, [drafts], [SamplingParams(temperature=0)], [10], _generator())
    assert out.token_ids == [emitted]
    assert out.num_accepted == [len(emitted) - 1]


def test_greedy_requests_in_one_batch_use_their_own_rows():
    logits = torch.cat([_one_hot_logits([3, 1]), _one_hot_logits([7]), _one_hot_logits([2, 2, 5])])
    drafts = [[3], [], [2, 0]]
    out = verify(logits, drafts, [SamplingParams(temperature=0)] * 3, [4, 9, 2], _generator())
    assert out.token_ids == [[3, 1], [7], [2, 2]]


def test_layout_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"num_rows\(drafts\)=3"):
        verify(torch.zeros(2, 8), [[1, 2]], [SamplingParams()], [0], _generator())
    with pytest.raises(ValueError, match="one entry per request"):
        verify(torch.zeros(2, 8), [[1]], [SamplingParams()], [0, 1], _generator())
    assert num_rows([[1, 2], [], [3]]) == 6


# --- the target's distribution is preserved ---------------------------------------------------

def test_first_token_is_distributed_as_the_target_whatever_the_draft():
    for draft in (1, 5):  # a likely and an unlikely draft
        out = verify(_batch([P1, P2], N), [[draft]] * N, _params(N), [0] * N, _generator(draft))
        _assert_distributed_as([t[0] for t in out.token_ids], P1)
        accepted = sum(out.num_accepted) / N
        assert abs(accepted - P1[draft].item()) < 4 * math.sqrt(P1[draft] * (1 - P1[draft]) / N)


def test_bonus_token_is_distributed_as_the_last_row():
    likely = torch.tensor([0.02, 0.9, 0.02, 0.02, 0.02, 0.02])  # the draft 1 is mostly accepted
    out = verify(_batch([likely, P2], N), [[1]] * N, _params(N), [0] * N, _generator())
    bonus = [t[1] for t in out.token_ids if len(t) == 2]
    assert len(bonus) > 0.85 * N
    _assert_distributed_as(bonus, P2)


def test_two_drafts_first_token_marginal_and_second_given_first():
    p3 = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.1, 0.1])
    out = verify(_batch([P1, P2, p3], N), [[0, 2]] * N, _params(N), [0] * N, _generator())
    _assert_distributed_as([t[0] for t in out.token_ids], P1)
    after_first = [t[1] for t in out.token_ids if len(t) >= 2]  # the first draft (0) was accepted
    _assert_distributed_as(after_first, P2)
    assert all(t[:len(t) - 1] == [0, 2][:len(t) - 1] for t in out.token_ids)


def test_filters_apply_and_a_filtered_out_draft_is_never_accepted():
    logits_p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
    params = [SamplingParams(temperature=0.5, top_k=3) for _ in range(N)]  # keeps 0, 1, 2, sharpened
    out = verify(_batch([logits_p, P2], N), [[4]] * N, params, [0] * N, _generator())
    assert sum(out.num_accepted) == 0
    kept = logits_p[:3] ** 2  # p^(1/T) with T = 0.5
    _assert_distributed_as([t[0] for t in out.token_ids], torch.cat([kept / kept.sum(), torch.zeros(3)]))


def test_seeded_draws_are_distributed_as_the_target_too():
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(N)]
    out = verify(_batch([P1, P2], N), [[1]] * N, params, [7] * N, _generator())
    _assert_distributed_as([t[0] for t in out.token_ids], P1)


# --- seeds and logprobs -----------------------------------------------------------------------

def _random_logits(rows, vocab=50, seed=1):
    return torch.randn(rows, vocab, generator=_generator(seed)) * 2


def test_seeded_request_emits_the_plain_samplers_tokens_whatever_the_batch():
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    mine = _random_logits(4)
    plain = sample(mine, [seeded] * 4, [20, 21, 22, 23], _generator()).token_ids
    for drafts, emitted in (([plain[0], plain[1], plain[2]], plain),        # all accepted + bonus
                            ([plain[0], (plain[1] + 1) % 50, 3], plain[:2])):  # second rejected
        alone = verify(mine, [drafts], [seeded], [20], _generator(1)).token_ids[0]
        companions = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, seed=5)]
        logits = torch.cat([_random_logits(3, seed=2), mine, _random_logits(1, seed=3)])
        batch = verify(logits, [[1, 2], drafts, []], [companions[0], seeded, companions[1]], [3, 20, 40],
                       _generator(2)).token_ids[1]
        assert alone == batch == emitted


def test_logprobs_are_the_plain_steps_for_each_emitted_token():
    logits = _random_logits(3)
    wants = SamplingParams(temperature=0, logprobs=2)
    greedy = logits.argmax(-1).tolist()
    out = verify(torch.cat([logits, logits[:1]]), [[greedy[0], (greedy[1] + 1) % 50], []],
                 [wants, SamplingParams(temperature=0)], [5, 5], _generator())
    assert out.token_ids == [greedy[:2], [greedy[0]]]
    plain = sample(logits[:2], [wants] * 2, [5, 6], _generator()).logprobs
    assert out.logprobs == [plain, None]
    assert len(out.logprobs[0][0][1]) == 2
