"""New weights written over a folder (same name, same shapes) while a kvstore process keeps
the old weights' blocks: the new model's workers import none of them, and answer as a cold
run of the new weights does.

    kvstore process  ─────────────── keeps running, memory backend ───────────────▶
    workers on F=A   ─write A's blocks─┤ restart on A ─hit A's─┤ F:=B, restart ─hit none─┤

A block is named by a hash rooted in the checkpoint's identity (engine/model/identity.py):
the digest of the files, not the folder's name. The counters that show what was imported:
the prefill worker's `kvstore_imported_tokens_total` (its prompt prefix read from the store;
the only way a worker takes blocks it did not write itself for this request), the decode
worker's same counter (the blocks its prefill just wrote under the handle), and the
kvstore's own `num_hits` / `num_blocks` (its Stats RPC, the /metrics counters' source).
The restart on unchanged A is the control: the same counters do count A's blocks there.
"""
from __future__ import annotations

import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.services.common.grpc_server import channel
from pdserve.services.decode.server import serve as serve_decode
from pdserve.services.kvstore.client import KVStoreClient
from pdserve.services.pb import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from pdserve.services.prefill.server import serve as serve_prefill
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.kv_integrity import REASONS
from tests.models import build_tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK_SIZE = 16
MAX_TOKENS = 6
# 70 and 53 tokens: 4 and 3 full blocks (the last prompt token is always computed, so a
# prefill looks up (len - 1) // 16 of them) and a partial tail each
PROMPTS = [list(range(1000, 1070)), list(range(3000, 3053))]
NUM_LOOKED_UP_BLOCKS = sum((len(p) - 1) // BLOCK_SIZE for p in PROMPTS)  # 4 + 3
# a decode reads its handle's full blocks and the partial tail (the tail key is dropped
# when its lease is released, so the store then counts the full blocks only)
NUM_DECODE_READS = NUM_LOOKED_UP_BLOCKS + len(PROMPTS)
NUM_DECODE_TOKENS = sum(map(len, PROMPTS))  # the whole prompts' KV (the first token's is computed there)


@pytest.fixture
def kvstore_process():
    """`python -m pdserve.services.kvstore.main` on a free loopback port, memory backend; SIGTERM at the end."""
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.services.kvstore.main", "--port", "0",
                             "--capacity-bytes", "64MiB"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        address = re.search(r"serving on (\S+),", _read_line(proc)).group(1)
        client = KVStoreClient(address)
        yield address, client
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _read_line(proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while not sel.select(timeout=0.1):
            assert proc.poll() is None, f"kvstore exited with {proc.returncode}"
            assert time.monotonic() < deadline, "kvstore printed nothing"
    return proc.stdout.readline()


@dataclass
class Round:
    """One start of a prefill and a decode worker on the folder, the prompts sent through
    both (prefill -> kvstore -> decode), then both stopped; what they counted."""
    outputs: list[list[int]]
    block_hashes: set[bytes]          # the prompts' full blocks, as these workers name them
    prefill_imported_tokens: float    # prompt prefix read from the kvstore by the prefill worker
    decode_imported_tokens: float     # KV read from the kvstore by the decode worker (its handle)
    num_rejected: float               # blocks read and refused (fingerprint, shape, ...), both workers
    store_hits: int                   # the kvstore's Get hits during the round
    store_new_blocks: int             # blocks the kvstore holds now and did not before


def _run_round(model: str, kvstore: str, client: KVStoreClient) -> Round:
    before = client.stats()
    # each worker loads the folder itself, as a worker process started on it does
    cfg = WorkerConfig(engine=EngineConfig(model=model, cache=CacheConfig(block_size=BLOCK_SIZE,
                                                                          kv_cache_memory_bytes=4 << 20)),
                       kvstore_address=kvstore)
    prefill, decode = serve_prefill(cfg), serve_decode(cfg)
    try:
        outputs = [_prefill_then_decode(prefill, decode, p, f"r{i}") for i, p in enumerate(PROMPTS)]
        hashes = {h for p in PROMPTS for h in prefill.loop.info.prompt_block_hashes(p, "")}
    finally:
        prefill.stop()  # drains: its KV writes and their EndWrite have ended
        decode.stop()
    after = client.stats()
    pm, dm = prefill.servicer.metrics, decode.servicer.metrics
    rejected = sum(m.kv_blocks_rejected.labels(r)._value.get() for m in (pm, dm) for r in REASONS)
    return Round(outputs, hashes, pm.kvstore_imported._value.get(), dm.kvstore_imported._value.get(), rejected,
                 after.num_hits - before.num_hits, after.num_blocks - before.num_blocks)


def _prefill_then_decode(prefill, decode, prompt: list[int], req_id: str) -> list[int]:
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with channel(prefill.address) as ch:
        first = prefill_pb2_grpc.PrefillWorkerStub(ch).Prefill(prefill_pb2.PrefillRequest(
            req_id=req_id, prompt_token_ids=prompt, sampling=sampling))
    assert first.kv_handle.kvstore_address  # the prompt's KV went through the kvstore
    with channel(decode.address) as ch:
        msgs = list(decode_pb2_grpc.DecodeWorkerStub(ch).Decode(decode_pb2.DecodeRequest(
            req_id=req_id, prompt_token_ids=prompt, first_token_id=first.choices[0].token_id,
            kv_handle=first.kv_handle, sampling=sampling)))
    return [first.choices[0].token_id] + [t for m in msgs for t in m.token_ids]


def _offline(model: str) -> list[list[int]]:
    """A cold run: the offline engine on the folder, nothing shared with any worker."""
    llm = LLM(model, kv_cache_memory_bytes=4 << 20, block_size=BLOCK_SIZE, progress=False)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)
    return [o.token_ids for o in outs]


def _write_over(folder: str, new_weights: str) -> None:
    """B's files copied over A's in place: the folder keeps its name, shapes stay equal."""
    for name in os.listdir(new_weights):
        shutil.copyfile(os.path.join(new_weights, name), os.path.join(folder, name))


def test_new_weights_in_the_folder_import_none_of_the_old_blocks(kvstore_process, tmp_path):
    address, client = kvstore_process
    folder = build_tiny_llama(tmp_path / "model", seed=0)   # A
    model_b = build_tiny_llama(tmp_path / "b", seed=1)      # B: same config and shapes
    cold_a = _offline(folder)

    first = _run_round(folder, address, client)
    assert first.outputs == cold_a
    assert first.prefill_imported_tokens == 0  # an empty store: nothing to import
    assert first.store_new_blocks == len(first.block_hashes) == NUM_LOOKED_UP_BLOCKS
    assert first.decode_imported_tokens == NUM_DECODE_TOKENS
    assert first.store_hits == NUM_DECODE_READS  # the decode's reads alone

    # control: new workers on unchanged A find A's blocks, and the counters count them
    control = _run_round(folder, address, client)
    assert control.outputs == cold_a
    assert control.block_hashes == first.block_hashes
    assert control.prefill_imported_tokens == NUM_LOOKED_UP_BLOCKS * BLOCK_SIZE
    # the prefill's reads of A's blocks, then the decode's of its handle
    assert control.store_hits == NUM_LOOKED_UP_BLOCKS + NUM_DECODE_READS
    assert control.store_new_blocks == 0
    assert control.num_rejected == 0

    _write_over(folder, model_b)
    cold_b = _offline(folder)
    # B answers every prompt otherwise: outputs equal to B's below show none of A's KV was used
    assert all(a != b for a, b in zip(cold_a, cold_b))
    swapped = _run_round(folder, address, client)
    assert swapped.outputs == cold_b
    assert not swapped.block_hashes & first.block_hashes  # other names for the same tokens
    assert sum(client.lookup([h]) for h in first.block_hashes) == NUM_LOOKED_UP_BLOCKS  # A's are all still there
    # nothing of A was imported: the prefill found no prefix in the store, so it computed
    # the prompts whole and wrote every block anew; every hit of the round was its decode
    # reading what this round's prefill had just written under the handle
    assert swapped.prefill_imported_tokens == 0
    assert swapped.store_new_blocks == len(swapped.block_hashes) == NUM_LOOKED_UP_BLOCKS
    assert swapped.decode_imported_tokens == NUM_DECODE_TOKENS
    assert swapped.store_hits == NUM_DECODE_READS  # as in the first round: its decode's reads alone
    assert swapped.num_rejected == 0  # and no worker even read a block of A to refuse it
