"""EngineCore.export_cached_blocks: a finished request's prompt + answer, by block hash, and
the next turn decoded from it token-exact."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.request import RequestMode

PROMPT = list(range(200, 237))  # 37 tokens
MAX_TOKENS = 11                 # 48 tokens in all: the third block holds the last token, which has no KV
NEW = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def make(tiny, tiny_llama_dir):
    return lambda: LLM(tiny_llama_dir, loaded_model=tiny, progress=False)


def _run(engine, request: EngineRequest):
    engine.add_request(request)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final


def _params(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _finished(engine):
    final = _run(engine, EngineRequest("turn1", PROMPT, _params()))
    return final, final.prompt_token_ids + final.token_ids


def test_exports_the_full_blocks_whose_kv_was_computed(make):
    engine = make().engine
    final, tokens = _finished(engine)
    assert len(tokens) == 48
    hashes = engine.info.prompt_block_hashes(tokens)
    assert len(hashes) == 3
    pool = engine.kv_manager.pool
    free_before = pool.free_block_queue.block_ids()
    payload = engine.export_cached_blocks(hashes)
    # the third block's last token was sampled, never fed: no KV, never cached
    assert payload.num_tokens == 32 and payload.num_blocks == 2 and payload.block_hashes == hashes[:2]
    assert tuple(payload.blocks.shape[1:]) == engine.info.kv_block_shape
    assert pool.free_block_queue.block_ids() == free_before  # copied out: no reference, no recency


def test_the_bytes_are_what_a_prefill_of_those_tokens_exports(make):
    engine, prefill = make().engine, make().engine
    _, tokens = _finished(engine)
    payload = engine.export_cached_blocks(engine.info.prompt_block_hashes(tokens))
    handed = _run(prefill, EngineRequest("p", tokens[:40], _params(), mode=RequestMode.PREFILL_ONLY)).kv_export
    assert handed.block_hashes[:2] == payload.block_hashes
    torch.testing.assert_close(payload.blocks, handed.blocks[:2], rtol=1e-5, atol=1e-5)


def test_only_the_leading_run_is_exported(make):
    engine = make().engine
    _, tokens = _finished(engine)
    h0, h1, _ = engine.info.prompt_block_hashes(tokens)
    unknown = b"\x01" * 32
    assert engine.export_cached_blocks([unknown, h0, h1]) is None
    assert engine.export_cached_blocks([h0, unknown, h1]).block_hashes == [h0]
    assert engine.export_cached_blocks([]) is None


def test_the_next_turn_decodes_from_it_token_exact(make):
    engine, decode, reference = make().engine, make().engine, make()
    _, tokens = _finished(engine)
    payload = engine.export_cached_blocks(engine.info.prompt_block_hashes(tokens))
    turn2 = tokens + NEW
    expected = reference.generate({"prompt_token_ids": turn2}, _params(8))[0].token_ids
    # imported as a decode-only request continuing after the reference's first token
    # (what a decode worker does with blocks read from the kvstore)
    out = _run(decode, EngineRequest("turn2", turn2, _params(8), mode=RequestMode.DECODE_ONLY,
                                     output_token_ids=expected[:1], kv_import=payload))
    assert out.token_ids == expected
    assert out.num_cached_tokens == 32  # the two exported blocks were used, not recomputed
