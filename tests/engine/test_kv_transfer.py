"""Prefill in one engine, export its KV, import it into another and decode: same tokens."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine import InvalidRequestError, LLM, SamplingParams
from pdserve.engine.kv_transfer import BlockChunks, KVPayload
from pdserve.engine.request import RequestMode
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.source import resolve_model
from pdserve.engine.engine_request import EngineRequest

PROMPTS = [list(range(200, 237)), list(range(900, 948)), [7, 8, 9], list(range(200, 230)) + [5] * 20]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    loaded = load_model(resolve_model(tiny_llama_dir), torch.float32, "cpu", progress=False)
    make = lambda: LLM(tiny_llama_dir, loaded_model=loaded, progress=False).engine  # noqa: E731
    reference = LLM(tiny_llama_dir, loaded_model=loaded, progress=False)
    expected = [o.token_ids for o in reference.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
    return make, expected


def _run(engine, add) -> dict:
    add()
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.req_id] = o
    return outs


def _prefill(engine) -> dict:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return _run(engine, lambda: [engine.add_request(EngineRequest(f"p{i}", p, params, mode=RequestMode.PREFILL_ONLY))
                                 for i, p in enumerate(PROMPTS)])


def _decode(engine, prefilled: dict, trim=lambda payload: payload) -> dict:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)

    def add():
        for i, p in enumerate(PROMPTS):
            out = prefilled[f"p{i}"]
            engine.add_request(EngineRequest(f"d{i}", p, params, mode=RequestMode.DECODE_ONLY,
                                             output_token_ids=out.token_ids, kv_import=trim(out.kv_export)))
    return _run(engine, add)


def test_exported_kv_decodes_to_the_same_tokens(engines):
    make, expected = engines
    prefill, decode = make(), make()
    prefilled = _prefill(prefill)
    for i, p in enumerate(PROMPTS):
        payload = prefilled[f"p{i}"].kv_export
        assert payload.num_tokens == len(p) and payload.num_blocks == -(-len(p) // 16)
        assert len(payload.block_hashes) == len(p) // 16
    assert prefill.kv_manager.num_free_blocks == prefill.kv_manager.pool.num_blocks
    outs = _decode(decode, prefilled)
    assert [outs[f"d{i}"].token_ids for i in range(len(PROMPTS))] == expected
    assert all(prefilled[f"p{i}"].token_ids == expected[i][:1] for i in range(len(PROMPTS)))
    assert {o.finish_reason for o in prefilled.values()} == {"handoff"}
    # imported full blocks became local prefix-cache entries under the same names
    pool = decode.kv_manager.pool
    assert all(pool.get_cached_block(h) is not None for h in prefilled["p1"].kv_export.block_hashes)
    assert decode.kv_manager.num_free_blocks == pool.num_blocks


def test_a_payload_received_in_chunks_decodes_the_same_tokens(engines):
    """As a decode worker receives a prompt's KV from the kvstore: in batches, never joined."""
    make, expected = engines
    prefilled = _prefill(make())

    def chunked(payload: KVPayload) -> KVPayload:
        b = payload.blocks
        cuts = sorted({0, 1, b.shape[0] // 2, b.shape[0]})
        return dataclasses.replace(payload, blocks=BlockChunks([b[lo:hi] for lo, hi in zip(cuts, cuts[1:])]))
    assert all(len(chunked(o.kv_export).blocks.chunks) > 1 for o in prefilled.values() if o.kv_export.num_blocks > 2)
    outs = _decode(make(), prefilled, trim=chunked)
    assert [outs[f"d{i}"].token_ids for i in range(len(PROMPTS))] == expected


def test_missing_blocks_are_recomputed(engines):
    make, expected = engines

    def first_block_only(payload: KVPayload) -> KVPayload | None:
        if payload.num_tokens <= 16:
            return None
        return KVPayload(16, payload.blocks[:1], payload.block_hashes[:1])
    outs = _decode(make(), _prefill(make()), first_block_only)
    assert [outs[f"d{i}"].token_ids for i in range(len(PROMPTS))] == expected


def test_text_continues_across_the_handoff(engines):
    make, _ = engines
    engine = make()
    tokenizer = engine.tokenizer
    offline = LLM(engine.config.model, loaded_model=engine.loaded, progress=False)
    full = offline.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    prefilled = _prefill(make())
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    engine.add_request(EngineRequest("d", PROMPTS[0], params, mode=RequestMode.DECODE_ONLY,
                                     output_token_ids=prefilled["p0"].token_ids, kv_import=prefilled["p0"].kv_export))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            deltas.append(o.new_text)
            final = o
    assert prefilled["p0"].text + "".join(deltas) == final.text == full.text
    assert full.text == tokenizer.decode(full.token_ids, skip_special_tokens=True)


def test_bad_imports_are_rejected(engines):
    make, _ = engines
    engine = make()
    good = _prefill(make())["p0"].kv_export
    params = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidRequestError, match="kv_import"):
        # covers every token: nothing to sample from
        engine.add_request(EngineRequest("x", PROMPTS[0], params, kv_import=good))
    with pytest.raises(InvalidRequestError, match="kv_import"):
        engine.add_request(EngineRequest("y", PROMPTS[0], params, mode=RequestMode.DECODE_ONLY, output_token_ids=[5],
                           kv_import=KVPayload(good.num_tokens, good.blocks[:, :1])))
    with pytest.raises(InvalidRequestError, match="output_token_ids"):
        engine.add_request(EngineRequest("z", PROMPTS[0], params, mode=RequestMode.DECODE_ONLY, output_token_ids=[-1]))
    assert not engine.has_unfinished_requests()


def test_a_prefill_whose_first_token_ends_the_request_finishes_without_handoff(engines):
    make, expected = engines
    engine = make()
    outs = _run(engine, lambda: [
        engine.add_request(EngineRequest("one", PROMPTS[0], SamplingParams(temperature=0, max_tokens=1),
                                         mode=RequestMode.PREFILL_ONLY)),
        engine.add_request(EngineRequest("stop", PROMPTS[1], SamplingParams(temperature=0, max_tokens=5,
                                                              stop_token_ids=[expected[1][0]]),
                           mode=RequestMode.PREFILL_ONLY))])
    assert (outs["one"].finish_reason, outs["stop"].finish_reason) == ("length", "stop")
    assert outs["one"].kv_export is None and outs["stop"].kv_export is None
    assert outs["one"].token_ids == expected[0][:1] and outs["stop"].token_ids == expected[1][:1]


def test_modes_are_checked_against_the_tokens_a_request_continues(engines):
    make, _ = engines
    engine = make()
    params = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidRequestError, match="output_token_ids"):
        engine.add_request(EngineRequest("a", PROMPTS[0], params, mode=RequestMode.DECODE_ONLY))
    with pytest.raises(InvalidRequestError, match="output_token_ids"):
        engine.add_request(EngineRequest("b", PROMPTS[0], params, output_token_ids=[5]))
    with pytest.raises(InvalidRequestError, match="output_token_ids"):
        engine.add_request(EngineRequest("c", PROMPTS[0], params, mode=RequestMode.PREFILL_ONLY, output_token_ids=[5]))
    with pytest.raises(InvalidRequestError, match="mode"):
        engine.add_request(EngineRequest("d", PROMPTS[0], params, mode="prefill"))
    assert not engine.has_unfinished_requests()


def _from_block(payload: KVPayload, first: int) -> KVPayload:
    """The payload less its first `first` blocks, as a reader holding them fetches it."""
    return KVPayload(payload.num_tokens, payload.blocks[first:], payload.block_hashes[first:], first)


def test_a_payload_carrying_only_what_follows_the_local_prefix_decodes_the_same(engines):
    """The receiver's prefix cache holds the first block(s); the import carries the rest
    (a reader skips what it holds); greedy tokens as the reference's."""
    make, expected = engines
    prefill, decode = make(), make()
    prefilled = _prefill(prefill)
    i, prompt = 1, PROMPTS[1]  # 48 tokens: 3 full blocks of 16 (the last one recomputed: 2 exported full)
    # warm the decode engine's prefix cache with the prompt's first block
    _run(decode, lambda: decode.add_request(EngineRequest("warm", prompt[:17], SamplingParams(max_tokens=1))))
    assert decode.num_local_prefix_blocks(prefilled[f"p{i}"].kv_export.block_hashes) == 1
    payload = _from_block(prefilled[f"p{i}"].kv_export, 1)
    outs = _run(decode, lambda: decode.add_request(EngineRequest(
        "d", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), mode=RequestMode.DECODE_ONLY,
        output_token_ids=prefilled[f"p{i}"].token_ids, kv_import=payload)))
    assert outs["d"].token_ids == expected[i]
    assert outs["d"].num_cached_tokens == payload.num_tokens  # one block hit, the rest imported, none computed


def test_a_payload_starting_past_the_local_prefix_is_not_used(engines):
    """The block before the payload's first is not held (evicted since the read was
    planned): the import would leave a gap, so the prompt is computed, tokens the same."""
    make, expected = engines
    prefill, decode = make(), make()
    prefilled = _prefill(prefill)
    i, prompt = 1, PROMPTS[1]
    payload = _from_block(prefilled[f"p{i}"].kv_export, 1)
    outs = _run(decode, lambda: decode.add_request(EngineRequest(
        "d", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), mode=RequestMode.DECODE_ONLY,
        output_token_ids=prefilled[f"p{i}"].token_ids, kv_import=payload)))
    assert outs["d"].token_ids == expected[i]
    assert outs["d"].num_cached_tokens == 0
