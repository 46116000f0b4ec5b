"""KV leaving the engine: a hand-off's prompt KV and cached blocks (engine/cached_kv_export.py),
written into memory the caller gives (EngineCore.set_kv_export_allocator), e.g. a buffer its
data plane sends from in place, so the export is the only copy; or, without an allocator or
when it fails, memory the engine allocates."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdserve.engine.cached_kv_export import export_cached_blocks
from pdserve.engine.dtypes import torch_dtype
from pdserve.engine.kv_transfer import KVLayout, KVPayload

if TYPE_CHECKING:
    from pdserve.engine.core.kv_cache_manager import KVCacheManager
    from pdserve.engine.request import Request
    from pdserve.engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class KVExporter:
    def __init__(self, kv_manager: KVCacheManager, runner: ModelRunner, layout: KVLayout):
        self._kv, self._runner, self._layout = kv_manager, runner, layout
        self._allocate: Callable[[int], torch.Tensor | None] | None = None

    def handoff(self, request: Request) -> KVPayload:
        """The KV of every computed token (the prompt; the token just sampled has none yet)."""
        bs, num_tokens = self._kv.block_size, request.num_computed_tokens
        block_ids = self._kv.get_block_ids(request.req_id)[:-(-num_tokens // bs)]
        return KVPayload(num_tokens, self._runner.export_blocks(block_ids, self.out(len(block_ids))),
                         list(self._kv.block_hashes(request, num_tokens // bs)))

    def cached(self, block_hashes: list[bytes]) -> KVPayload | None:
        """The leading run of `block_hashes` still in the prefix cache; None: not even the first."""
        return export_cached_blocks(self._kv, self._runner, block_hashes, self.out)

    def set_allocator(self, allocate: Callable[[int], torch.Tensor | None] | None) -> None:
        """`allocate(nbytes)` gives host memory (a uint8 tensor of at least nbytes) or None
        (the engine allocates, as without one). Called on the engine's thread, once per export;
        an allocator that raises is logged and the engine allocates."""
        self._allocate = allocate

    def out(self, num_blocks: int) -> torch.Tensor | None:
        """The tensor `num_blocks` exported blocks are written into; None: the engine allocates."""
        allocate = self._allocate
        if allocate is None or num_blocks == 0:
            return None
        layout = self._layout
        nbytes = num_blocks * layout.block_nbytes
        try:
            buffer = allocate(nbytes)
        except Exception as e:  # the caller's memory is an optimisation: the export goes on without it
            logger.warning("the KV export allocator failed (%s); the engine allocates", e)
            return None
        if buffer is None:
            return None
        if buffer.dtype != torch.uint8 or buffer.device.type != "cpu" or buffer.numel() < nbytes \
                or not buffer.is_contiguous():
            logger.warning("the KV export allocator gave %s %s on %s for %d bytes (not host uint8 that long); "
                           "the engine allocates", tuple(buffer.shape), buffer.dtype, buffer.device, nbytes)
            return None
        return buffer[:nbytes].view(torch_dtype(layout.dtype)).view(num_blocks, *layout.block_shape)
