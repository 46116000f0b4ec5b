"""What the driver sends its ranks, as typed binary messages (no pickle).

A message starts with a fixed header on the rank's control pipe (its stdin); bulk data
follows as tensors broadcast on the gloo group. The pipe carries the "what next" because
a rank waits on it between steps for as long as the engine idles, which a collective
with a timeout cannot do; and its end of file tells a rank that the driver is gone.

    INIT        a = KV blocks to allocate, b = host-tier slots (each rank's buffer of its part)
    STEP        a = micro-batches, b = int64 payload length; then a x 7 shape fields,
                then the payload broadcast (StepInputs.pack)
    KV_IMPORT   a = blocks; then a block ids; then the blocks broadcast, whole (every
                layer and KV head): each rank keeps its part
    KV_EXPORT   a = blocks; then a block ids; each rank holding KV heads first sends its
                part to the driver
    HOST_COPY   a = offloads, b = onloads; then a (block id, slot) pairs, then b (slot,
                block id) pairs, flat: each rank copies its part between its cache and its
                host buffer (the host tier's copies of SchedulerOutput), before the step's STEP
    SHUTDOWN
"""
from __future__ import annotations

import struct
from typing import BinaryIO

import torch

from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.worker.step_batch import StepInputs

INIT, STEP, KV_IMPORT, KV_EXPORT, SHUTDOWN, HOST_COPY = 1, 2, 3, 4, 5, 6
HEADER = struct.Struct("<qqq")  # op, a, b
SHAPE_FIELDS = 7


def write_message(pipe: BinaryIO, op: int, a: int = 0, b: int = 0, ints: list[int] = ()) -> None:
    pipe.write(HEADER.pack(op, a, b) + struct.pack(f"<{len(ints)}q", *ints))
    pipe.flush()


def read_exact(pipe: BinaryIO, n: int) -> bytes | None:
    """n bytes, or None at end of file (the driver is gone)."""
    data = b""
    while len(data) < n:
        chunk = pipe.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def read_ints(pipe: BinaryIO, n: int) -> list[int] | None:
    data = read_exact(pipe, 8 * n)
    return None if data is None else list(struct.unpack(f"<{n}q", data))


def pack_pairs(*pair_lists: list[tuple[int, int]]) -> list[int]:
    """Pairs of ints, flat, list after list (HOST_COPY's ints)."""
    return [x for pairs in pair_lists for pair in pairs for x in pair]


def unpack_pairs(ints: list[int], *counts: int) -> list[list[tuple[int, int]]]:
    """pack_pairs undone: `counts` pairs each."""
    lists, at = [], 0
    for n in counts:
        lists.append(list(zip(ints[at:at + 2 * n:2], ints[at + 1:at + 2 * n:2])))
        at += 2 * n
    return lists


def pack_step(batches: list[StepInputs]) -> tuple[list[int], torch.Tensor]:
    shapes = [f for b in batches for f in b.shape_fields()]
    return shapes, torch.cat([b.pack() for b in batches])


def unpack_step(shapes: list[int], payload: torch.Tensor, device: torch.device) -> list[StepInputs]:
    batches, offset = [], 0
    payload = payload.to(device)

    def take(n: int, dtype: torch.dtype) -> torch.Tensor:
        nonlocal offset
        part = payload[offset:offset + n].to(dtype)
        offset += n
        return part

    for i in range(0, len(shapes), SHAPE_FIELDS):
        tokens, seqs, max_blocks, logits, num_decodes, max_q, max_seq = shapes[i:i + SHAPE_FIELDS]
        input_ids, positions = take(tokens, torch.long), take(tokens, torch.long)
        starts, seq_lens = take(seqs + 1, torch.int32), take(seqs, torch.int32)
        tables = take(seqs * max_blocks, torch.int32).view(seqs, max_blocks)
        slots = take(tokens, torch.int64)
        meta = AttentionMetadata(num_decodes=num_decodes, query_start_loc=starts, seq_lens=seq_lens,
                                 block_tables=tables, slot_mapping=slots, max_query_len=max_q, max_seq_len=max_seq)
        batches.append(StepInputs(input_ids, positions, meta, take(logits, torch.long)))
    return batches
