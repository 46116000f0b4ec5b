"""Prompt lookup: exact drafts on hand-made sequences, and the buffer that makes it cheap."""
from __future__ import annotations

import pytest

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.spec_decode.ngram import NgramProposer
from pdserve.engine.spec_decode.proposer import DraftRequest


def _propose(tokens, k=3, lo=1, hi=3, max_drafts=16):
    return NgramProposer(k, lo, hi).propose([DraftRequest("r", list(tokens), max_drafts)])["r"]


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    tokens = [1, 2, 3, 4, 5, 2, 3, 8, 9, 1, 2, 3]
    assert _propose(tokens, hi=3) == [4, 5, 2]   # "1 2 3" at 0..2
    assert _propose(tokens, hi=2) == [8, 9, 1]   # only "2 3" tried: its most recent occurrence


def test_most_recent_occurrence_wins():
    assert _propose([5, 6, 1, 5, 6, 2, 7, 5, 6], lo=2, hi=2) == [2, 7, 5]


def test_max_drafts_and_num_speculative_tokens_bound_the_drafts():
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert _propose(tokens, k=4) == [3, 4, 5, 6]
    assert _propose(tokens, k=4, max_drafts=2) == [3, 4]
    assert _propose(tokens, k=1) == [3]


def test_no_match_gives_no_drafts_and_min_n_is_respected():
    assert _propose([1, 2, 3, 4]) == []
    assert _propose([7]) == []
    assert _propose([7, 1, 2, 9, 2], lo=2, hi=3) == []   # only "2" recurs, shorter than min 2
    assert _propose([7, 1, 2, 9, 2], lo=1, hi=3) == [9, 2, 9]


def test_the_suffix_itself_is_never_a_match():
    assert _propose([1, 2, 3], lo=1, hi=3) == []
    assert _propose([4, 1, 2, 3], lo=3, hi=3) == []  # "1 2 3" occurs only as the suffix


def test_a_continuation_reaching_the_end_repeats_its_period():
    assert _propose([1, 2, 1, 2], k=5, lo=2, hi=2) == [1, 2, 1, 2, 1]
    assert _propose([9, 5, 5, 5, 5], k=3, hi=4) == [5, 5, 5]
    assert _propose([1, 2, 3, 1, 2], k=5, lo=2, hi=2) == [3, 1, 2, 3, 1]


def test_each_request_is_looked_up_in_its_own_tokens():
    proposer = NgramProposer(2, 1, 2)
    out = proposer.propose([DraftRequest("a", [1, 2, 3, 1], 4), DraftRequest("b", [4, 5, 6], 4)])
    assert out == {"a": [2, 3], "b": []}


def test_buffered_tokens_follow_growth_and_a_reused_req_id():
    proposer = NgramProposer(2, 1, 2)
    tokens = [1, 2, 3, 4]
    assert proposer.propose([DraftRequest("r", tokens, 2)])["r"] == []
    tokens += [1, 2]  # grew by two accepted tokens
    assert proposer.propose([DraftRequest("r", tokens, 2)])["r"] == [3, 4]
    # the same id with unrelated tokens (not an extension): rebuilt, not mixed with the old ones
    assert proposer.propose([DraftRequest("r", [7, 8, 7], 2)])["r"] == [8, 7]
    assert proposer.propose([DraftRequest("r", [9, 9, 9, 9, 9, 9, 3], 2)])["r"] == []
    proposer.finish("r")
    assert proposer.propose([DraftRequest("r", [5, 6, 5], 2)])["r"] == [6, 5]


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_speculative_tokens=0, prompt_lookup_min=1, prompt_lookup_max=2), "num_speculative_tokens"),
    (dict(num_speculative_tokens=2, prompt_lookup_min=0, prompt_lookup_max=2), "prompt_lookup_min"),
    (dict(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min"),
    (dict(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=True), "prompt_lookup_max"),
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        NgramProposer(**kwargs)
    assert e.value.field == f"speculative_config.{field}"
