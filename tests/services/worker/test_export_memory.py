"""Where a worker's engine exports the KV it puts (services/worker/runtime.py): on the CPU,
buffers reused once nothing views them, never one still being sent."""
from __future__ import annotations

import torch

from pdserve.services.worker.runtime import EXPORT_BUFFERS, choose_kv_export_memory


class _Engine:
    allocate = None

    def set_kv_export_allocator(self, allocate):
        self.allocate = allocate


class _KVStore:
    def __init__(self, transport: str):
        self.transport, self.mooncake_local_node = transport, "off"


def _allocator(transport: str = "tcp", device: str = "cpu"):
    engine = _Engine()
    choose_kv_export_memory(engine, _KVStore(transport), device)
    return engine.allocate


def test_a_cpu_export_reuses_memory_once_its_put_let_go_of_it():
    allocate = _allocator()
    first = allocate(1 << 20)
    address = first.data_ptr()
    first.view(torch.float32)[:4] = 1.5
    in_flight = first[:256].view(torch.float32)  # a view the put still holds
    del first
    second = allocate(1 << 20)
    assert second.data_ptr() != address  # the first is still viewed
    del in_flight
    third = allocate(1 << 19)  # smaller than a free one: that one, viewed to the size
    assert third.data_ptr() == address and third.numel() == 1 << 19 and third.dtype == torch.uint8


def test_more_exports_in_flight_than_kept_each_get_memory_of_their_own():
    allocate = _allocator("grpc")
    held = [allocate(4096) for _ in range(EXPORT_BUFFERS + 2)]
    assert len({t.data_ptr() for t in held}) == EXPORT_BUFFERS + 2


def test_a_gpu_worker_keeps_the_engines_own_allocation():
    assert _allocator(device="cuda") is None
    assert _allocator(device="cuda:1") is None
