"""The draft-model proposer: its drafts are the draft model's greedy continuation, batched,
after any rollback; its own KV blocks never leak; a full cache or a padded vocabulary never
makes it fail or propose an id past the tokenizer."""
from __future__ import annotations

import dataclasses
import logging
import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model.loader import LoadedModel, load_model
from pdserve.engine.model.source import resolve_model
from pdserve.engine.spec_decode.draft_model import DraftModelProposer
from pdserve.engine.spec_decode.proposer import DraftRequest
from tests.models import build_tiny_llama

K = 4
BLOCK_SIZE = 16
LENGTHS = [1, 5, 16, 17, 40, 100]


def _block_bytes(loaded: LoadedModel) -> int:
    arch = loaded.arch
    return 2 * arch.num_layers * BLOCK_SIZE * arch.num_kv_heads * arch.head_dim * 4  # float32


def _proposer(loaded, num_blocks: int = 64, backend: str = "cpu", **kwargs) -> DraftModelProposer:
    return DraftModelProposer(loaded, K, "cpu", "float32", num_blocks * _block_bytes(loaded), BLOCK_SIZE,
                              backend, **kwargs)


def _prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


class Greedy:
    """The target engine's greedy continuation of token_ids: what the draft must propose."""

    def __init__(self, loaded: LoadedModel, path: str):
        self.llm = LLM(model=path, loaded_model=loaded, progress=False, kv_cache_memory_bytes=4 << 20)

    def __call__(self, token_ids: list[list[int]], k: int = K) -> list[list[int]]:
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in token_ids],
                                 SamplingParams(temperature=0, max_tokens=k, ignore_eos=True))
        return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def greedy(tiny, tiny_llama_dir) -> Greedy:
    return Greedy(tiny, tiny_llama_dir)


def _propose(proposer, token_ids: list[list[int]], max_drafts=K) -> list[list[int]]:
    drafts = proposer.propose([DraftRequest(f"r{i}", ids, max_drafts) for i, ids in enumerate(token_ids)])
    return [drafts[f"r{i}"] for i in range(len(token_ids))]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_self_draft_equals_target_greedy_in_one_batch(tiny, greedy, backend):
    prompts = _prompts(tiny.arch.vocab_size, LENGTHS)
    proposer = _proposer(tiny, backend=backend)
    assert _propose(proposer, prompts) == greedy(prompts)


def test_triton_backend_matches_greedy(tiny, greedy):
    """The GPU backend's metadata (in Triton's interpreter here): a mixed catch-up batch, then decodes."""
    prompts = _prompts(tiny.arch.vocab_size, [1, 5, 17, 20], seed=4)
    proposer = _proposer(tiny, backend="triton")
    drafts = _propose(proposer, prompts)
    assert drafts == greedy(prompts)
    token_ids = [p + d[:j] + [7] for p, d, j in zip(prompts, drafts, [0, 1, 4, 2])]
    assert _propose(proposer, token_ids) == greedy(token_ids)


def test_max_drafts_bounds_each_request(tiny, greedy):
    prompts = _prompts(tiny.arch.vocab_size, [3, 20, 33])
    proposer = _proposer(tiny)
    got = proposer.propose([DraftRequest(f"r{i}", p, m) for i, (p, m) in enumerate(zip(prompts, [1, 4, 2]))])
    expected = greedy(prompts)
    assert [got["r0"], got["r1"], got["r2"]] == [expected[0][:1], expected[1], expected[2][:2]]


def test_rollback_after_rejection_gives_the_new_greedy_continuation(tiny, greedy):
    """Round after round, as verification would: accept j drafts, append another token."""
    vocab = tiny.arch.vocab_size
    token_ids = _prompts(vocab, [7, 16, 30, 45])
    proposer = _proposer(tiny)
    drafts = _propose(proposer, token_ids)
    rng = random.Random(1)
    for round_ in range(4):
        # r0 rejects the first draft, r1 the third, r2 accepts all and adds a bonus, r3 stays put
        for i, j in enumerate([0, 2, K, None]):
            if j is not None:
                rejected = drafts[i][j] if j < K else -1
                token_ids[i] = token_ids[i] + drafts[i][:j] + [_other(rng, vocab, rejected)]
        if round_ == 2:  # a new request joins a batch of catch-ups
            token_ids.append(_prompts(vocab, [25], seed=round_)[0])
        drafts = _propose(proposer, token_ids)
        assert drafts == greedy(token_ids)


def test_changed_history_is_recomputed_from_the_first_difference(tiny, greedy):
    """Only the common prefix of the cached tokens and the new token_ids is trusted."""
    a, b = _prompts(tiny.arch.vocab_size, [40, 40], seed=9)
    proposer = _proposer(tiny)
    _propose(proposer, [a])
    changed = a[:20] + b[20:] + [a[-1]]  # longer than before, but differs from position 20
    assert _propose(proposer, [changed]) == greedy([changed])


def _other(rng: random.Random, vocab: int, not_this: int) -> int:
    while (token := rng.randrange(3, vocab)) == not_this:
        pass
    return token


def test_finish_returns_every_block(tiny):
    proposer = _proposer(tiny)
    prompts = _prompts(tiny.arch.vocab_size, LENGTHS)
    drafts = _propose(proposer, prompts)
    # the KV covers the prompt and all drafts but the last
    used = sum(-(-(len(p) + K - 1) // BLOCK_SIZE) for p in prompts)
    assert proposer.num_free_blocks == proposer.num_blocks - used
    # a rollback to a short prefix gives the blocks past it back: 103 tokens in 7 blocks, then 13 in 1
    proposer.propose([DraftRequest("r5", prompts[5][:10], K)])
    assert proposer.num_free_blocks == proposer.num_blocks - used + 6
    for i in range(len(prompts)):
        proposer.finish(f"r{i}")
    assert proposer.num_free_blocks == proposer.num_blocks
    assert sorted(proposer._free_block_ids) == list(range(proposer.num_blocks))
    proposer.finish("r0")  # twice, or never proposed for: nothing happens
    assert all(len(d) == K for d in drafts) and proposer.num_free_blocks == proposer.num_blocks


def test_full_cache_gives_no_drafts_and_no_error(tiny, greedy, caplog):
    proposer = _proposer(tiny, num_blocks=4)  # 64 tokens
    a, b, huge = _prompts(tiny.arch.vocab_size, [40, 30, 100])
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.spec_decode.draft_model"):
        got = proposer.propose([DraftRequest("a", a, K), DraftRequest("b", b, K), DraftRequest("huge", huge, K)])
        assert got == {"a": greedy([a])[0]}  # a holds 3 blocks; b needs 3, 1 is left
        assert proposer.propose([DraftRequest("b", b, K)]) == {}
    assert sum("KV cache is full" in r.message for r in caplog.records) == 1  # said once
    proposer.finish("a")
    assert proposer.propose([DraftRequest("b", b, K)]) == {"b": greedy([b])[0]}


def test_past_the_draft_context_no_drafts(tiny):
    """Drafts stop at the last position the draft's RoPE tables hold."""
    proposer = _proposer(tiny, num_blocks=256)
    limit = proposer.max_positions
    ids = _prompts(tiny.arch.vocab_size, [limit + 1])[0]
    assert proposer.propose([DraftRequest("r", ids, K)]) == {}
    assert len(proposer.propose([DraftRequest("r", ids[:limit], K)])["r"]) == 1
    assert len(proposer.propose([DraftRequest("r", ids[:limit - 2], K)])["r"]) == 3


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory) -> str:
    """A second random model, smaller and seeded differently, with the same tokenizer."""
    return build_tiny_llama(tmp_path_factory.mktemp("other-tiny"), num_layers=1, hidden_size=32, num_heads=2,
                            num_kv_heads=1, seed=7)


def test_other_model_as_draft_from_its_path(tiny, other_dir):
    other = load_model(resolve_model(other_dir), torch.float32, "cpu", progress=False)
    prompts = _prompts(tiny.arch.vocab_size, LENGTHS, seed=3)
    proposer = DraftModelProposer(other_dir, K, "cpu", "float32", 1 << 20, vocab_limit=len(tiny.tokenizer))
    drafts = _propose(proposer, prompts)
    assert drafts == Greedy(other, other_dir)(prompts)  # the draft's own greedy continuation
    assert all(len(d) == K and max(d) < len(tiny.tokenizer) for d in drafts)


def test_padded_vocabulary_never_proposed(other_dir):
    """Padding rows that would win every argmax: masked, never proposed."""
    loaded = load_model(resolve_model(other_dir), torch.float32, "cpu", progress=False)
    vocab, pad = loaded.arch.vocab_size, 64
    model = loaded.model
    with torch.no_grad():
        rows = torch.randn(pad, model.embed_tokens.embedding_dim, generator=torch.Generator().manual_seed(0))
        weight = torch.cat([model.embed_tokens.weight, 100 * rows])
    model.embed_tokens = torch.nn.Embedding.from_pretrained(weight, freeze=True)  # tied: the LM head too
    padded = dataclasses.replace(loaded, arch=dataclasses.replace(loaded.arch, vocab_size=vocab + pad))
    prompts = _prompts(vocab, LENGTHS, seed=5)
    unmasked = _propose(_proposer(padded, vocab_limit=vocab + pad), prompts)
    assert max(max(d) for d in unmasked) >= vocab  # the padding would be proposed
    masked = _propose(_proposer(padded), prompts)  # default bound: the tokenizer's length
    assert all(len(d) == K and max(d) < vocab == len(loaded.tokenizer) for d in masked)


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes"),
    (dict(kv_cache_memory_bytes=100), "kv_cache_memory_bytes"),  # less than one block
    (dict(vocab_limit=10 ** 9), "vocab_limit"),
    (dict(block_size=0), "block_size"),
])
def test_bad_arguments_name_the_field(tiny, kwargs, field):
    args = dict(model=tiny, num_speculative_tokens=K, device="cpu", dtype="float32",
                kv_cache_memory_bytes=1 << 20) | kwargs
    with pytest.raises(ValueError, match=field):
        DraftModelProposer(**args)
