"""Which of a KV handle's blocks a decode worker reads from its kvstore: pure, no I/O.

    tokens      |  block 0  |  block 1  |  block 2  | tail |last|
    handle      |<-------------- num_tokens ------------->|
    read        |  hash 0   |  hash 1   |  hash 2   | tail |      the last token's KV is
                                                                  always computed here

The blocks are named by the worker's own hashes of the tokens, never the handle's (a
handle naming other blocks is read as the prompt's). The tail is read only when it is a
partial block that still leaves the last token to compute; otherwise it is recomputed.
Blocks the worker's own prefix cache holds (a conversation's earlier turns, on the decode
worker that streamed them) are not read again: the read starts after them.

    local       |  block 0  |  block 1  |
    read                                |  hash 2   | tail |      first_block = 2
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.services.pb import common_pb2
from pdserve.services.worker.kv_integrity import KVSTORE_ADDRESS

# How long a read waits for the prefill's write of the blocks to end. A write takes well
# under a second; one that takes longer is stuck, and recomputing beats waiting on.
KV_WRITE_WAIT_MS = 10_000


@dataclass(frozen=True)
class ReadPlan:
    """What to ask the kvstore for, under the handle's lease."""
    block_hashes: list[bytes]
    tail_key: str          # "" when no tail is read
    num_tail_tokens: int   # 0 when no tail is read
    lease_id: str
    wait_ms: int           # how long the store waits for the lease's write to end
    names_other_blocks: bool  # the handle's hashes are not the prompt's (read the prompt's)
    first_block: int = 0   # the request's index of block_hashes[0]: the worker holds those before it

    @property
    def num_asked(self) -> int:
        return len(self.block_hashes) + bool(self.num_tail_tokens)

    @property
    def tail_keys(self) -> list[str]:
        return [self.tail_key] if self.tail_key else []


@dataclass(frozen=True)
class ReadRefusal:
    """A handle not followed: its blocks are recomputed."""
    reason: str     # the kv_blocks_rejected label
    num_asked: int  # blocks the handle would have given, all recomputed now


def plan_read(handle: common_pb2.KVHandle, token_hashes: list[bytes], num_tokens: int, block_size: int,
              own_kvstore_address: str, num_local_blocks: int = 0) -> ReadPlan | ReadRefusal | None:
    """`token_hashes`: this worker's hashes of the request's full blocks (prompt and the
    tokens given), `num_tokens` their token count, `num_local_blocks` how many leading
    ones its prefix cache holds. None: the handle names no kvstore (nothing was written).
    A refusal for a handle naming another kvstore than the worker's own: a forged handle
    would otherwise point the worker at any server."""
    if not handle.kvstore_address:
        return None
    hashes = token_hashes[:handle.num_tokens // block_size]
    num_tail_tokens = _num_tail_tokens(handle, len(hashes), num_tokens, block_size)
    if handle.kvstore_address != own_kvstore_address:
        return ReadRefusal(KVSTORE_ADDRESS, len(hashes) + bool(num_tail_tokens))
    first = min(num_local_blocks, len(hashes))
    return ReadPlan(hashes[first:], handle.tail_key if num_tail_tokens else "", num_tail_tokens, handle.lease_id,
                    KV_WRITE_WAIT_MS if handle.lease_id else 0, list(handle.block_hashes) != hashes, first)


def _num_tail_tokens(handle: common_pb2.KVHandle, num_blocks: int, num_tokens: int, block_size: int) -> int:
    tail = handle.num_tokens - num_blocks * block_size if handle.tail_key else 0
    leaves_last_token = num_blocks * block_size + tail < num_tokens
    return tail if 0 < tail < block_size and leaves_last_token else 0
