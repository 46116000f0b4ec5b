"""EngineCore.set_kv_export_allocator: exported KV lands in memory the caller hands out (the
kvstore transport's shared memory, so a put sends it where it lies), byte for byte what the
engine's own export is; an allocator that gives nothing usable changes nothing."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.request import RequestMode
from pdserve.engine.worker.kv_cache import export_blocks
from tests.engine.correctness import run_to_completion

PROMPT = list(range(300, 341))  # 41 tokens: two full blocks and a partial one


@pytest.fixture(scope="module")
def make(tiny, tiny_llama_dir):
    return lambda: LLM(tiny_llama_dir, loaded_model=tiny, progress=False).engine


def _prefill(engine, req_id: str):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return run_to_completion(engine, [(req_id, PROMPT, params, {"mode": RequestMode.PREFILL_ONLY})])[req_id]


class Arena:
    """Hands out slices of one uint8 tensor, as the transport hands out its buffers."""

    def __init__(self, nbytes: int):
        self.memory = torch.zeros(nbytes, dtype=torch.uint8)
        self.asked: list[int] = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.asked.append(nbytes)
        return self.memory[:nbytes + 64]  # longer than asked: only the first nbytes are used


def _inside(tensor: torch.Tensor, memory: torch.Tensor) -> bool:
    start = memory.data_ptr()
    return start <= tensor.data_ptr() and tensor.data_ptr() + tensor.numel() * tensor.element_size() <= \
        start + memory.numel()


def test_a_prefills_export_lands_in_the_given_memory_and_is_the_engines_own(make):
    reference = _prefill(make(), "ref").kv_export
    engine, arena = make(), Arena(8 << 20)
    engine.set_kv_export_allocator(arena)
    export = _prefill(engine, "p").kv_export
    assert arena.asked == [export.blocks.numel() * export.blocks.element_size()]
    assert _inside(export.blocks, arena.memory)
    assert export.blocks.dtype == reference.blocks.dtype and export.blocks.shape == reference.blocks.shape
    assert torch.equal(export.blocks, reference.blocks) and export.block_hashes == reference.block_hashes


def test_a_cached_blocks_export_lands_in_the_given_memory_too(make):
    engine = make()
    _prefill(engine, "p")
    hashes = engine.info.prompt_block_hashes(PROMPT)
    plain = engine.export_cached_blocks(hashes)
    arena = Arena(8 << 20)
    engine.set_kv_export_allocator(arena)
    given = engine.export_cached_blocks(hashes)
    assert _inside(given.blocks, arena.memory) and torch.equal(given.blocks, plain.blocks)
    engine.set_kv_export_allocator(None)  # back to the engine's own memory
    assert not _inside(engine.export_cached_blocks(hashes).blocks, arena.memory)


def _raises(nbytes: int):
    raise RuntimeError("no memory today")


@pytest.mark.parametrize("allocate", [
    lambda nbytes: None,                                    # none to give
    _raises,                                                # the allocator fails
    lambda nbytes: torch.zeros(nbytes - 1, dtype=torch.uint8),  # too short
    lambda nbytes: torch.zeros(nbytes, dtype=torch.float32),    # not bytes
], ids=["none", "raises", "too-short", "not-uint8"])
def test_an_allocator_that_gives_nothing_usable_leaves_the_export_as_it_was(make, allocate):
    reference = _prefill(make(), "ref").kv_export
    engine = make()
    engine.set_kv_export_allocator(allocate)
    export = _prefill(engine, "p").kv_export
    assert torch.equal(export.blocks, reference.blocks)


def test_export_blocks_refuses_memory_of_another_shape_naming_it():
    caches = [torch.zeros((2, 4, 4, 2, 8)) for _ in range(3)]
    with pytest.raises(ValueError, match="out: "):
        export_blocks(caches, [0, 1], torch.empty((2, 3, 2, 4, 2, 7)))
    with pytest.raises(ValueError, match="out: "):
        export_blocks(caches, [0, 1], torch.empty((2, 3, 2, 4, 2, 8), dtype=torch.float64))
    out = torch.empty((2, 3, 2, 4, 2, 8))
    assert export_blocks(caches, [0, 1], out).data_ptr() == out.data_ptr()
