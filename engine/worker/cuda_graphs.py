"""Decode steps replayed from CUDA graphs: one captured forward per batch size ("bucket").

A decode step of a small model is mostly kernel launches: the GPU finishes each tiny kernel
before Python has launched the next. A CUDA graph records the whole forward once and
replays it with one launch, but only over fixed tensors: the graph reads its inputs from
static buffers at fixed addresses, and every shape and host-side value in it is frozen.

So a step runs through a graph when every scheduled request has exactly one token and the
batch fits the largest bucket. Its inputs are copied into the static buffers, padded up to
the smallest bucket that holds it:

    batch of 5 -> bucket 8:   rows [r0 r1 r2 r3 r4 | pad pad pad]
    pad row: cache slot -1    (the cache write skips negative slots: nothing is written)
             context length 1 (attention reads one key of a valid block; the result is dropped)

and only the real rows' logits are kept. Every other step (a prefill chunk in it, or more
requests than the largest bucket) runs eagerly, as without graphs.

Frozen host values: attention gets max_query_len = 1 and max_seq_len = max_model_len. The
Triton decode kernel sizes its grid and split-KV partials from max_seq_len, and partitions
past a sequence's own length exit at once, so one graph serves every context length. The
price: a graph always launches cdiv(max_model_len, 512) partitions (a windowed layer's:
cdiv(min(max_model_len, W), 512)) and the reduction, where
an eager step of short contexts runs one partition and no reduction. (A single partition's
result is acc / l either way: the reduction rescales it by 2^0 = 1.)
"""
from __future__ import annotations

import bisect
import functools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from pdserve.engine.attention.backend import AttentionMetadata

if TYPE_CHECKING:
    from pdserve.engine.worker.step_batch import StepBatch

logger = logging.getLogger(__name__)

# forward(input_ids, positions, meta, logits_indices) -> float32 logits [rows, vocab]
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]


class Graph(ABC):
    """A computation over static buffers, recorded once: replay() recomputes `output` from
    whatever the buffers hold now. `output` is valid until the next replay of any graph of
    the same pool."""

    output: torch.Tensor

    @staticmethod
    @abstractmethod
    def new_pool():
        """The memory pool the graphs of one runner share."""

    @abstractmethod
    def replay(self) -> None: ...


class CudaGraph(Graph):
    def __init__(self, fn: Callable[[], torch.Tensor], pool):
        # One eager run first: Triton compiles and loads its kernels on their first launch,
        # which must not happen inside a capture.
        fn()
        torch.cuda.synchronize()
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph, pool=pool):
            self.output = fn()

    @staticmethod
    def new_pool():
        return torch.cuda.graph_pool_handle()

    def replay(self) -> None:
        self._graph.replay()


class EagerGraph(Graph):
    """The stand-in the CPU tests use: "replay" runs `fn` again on the same static buffers,
    so everything but the capture itself (bucketing, padding, stale rows in reused buffers)
    runs as it does on a GPU."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool):
        self._fn = fn
        self.output = fn()
        self.num_replays = 0

    @staticmethod
    def new_pool():
        return None

    def replay(self) -> None:
        self.output = self._fn()
        self.num_replays += 1


def sizes_to_capture(batch_sizes: Sequence[int], max_num_seqs: int) -> list[int]:
    """Sorted, without duplicates, and without sizes no step can reach: a step holds at most
    max_num_seqs requests, so sizes above the smallest one that holds them are dropped.

        (1, 2, 4, 8, 16, 32, 64), max_num_seqs 12  ->  [1, 2, 4, 8, 16]
    """
    sizes = sorted(set(batch_sizes))
    cover = bisect.bisect_left(sizes, max_num_seqs)
    return sizes[:cover + 1]


class DecodeGraphs:
    """The static input buffers and one graph per bucket, captured largest first: every graph
    allocates from one shared pool, so the smaller ones reuse the largest one's memory. That
    is safe because graphs replay one at a time on one stream and each step's logits are
    consumed (sampled) before the next replay."""

    def __init__(self, forward: Forward, batch_sizes: Sequence[int], max_model_len: int, block_size: int,
                 device: torch.device, graph_type: type[Graph] = CudaGraph):
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_model_len = max_model_len
        max_size, max_blocks = self.batch_sizes[-1], -(-max_model_len // block_size)

        def buffer(*shape, dtype, fill=0):
            return torch.full(shape, fill, dtype=dtype, device=device)
        # Rows of the largest bucket; a bucket uses the first rows. Padding as drawn above.
        self.input_ids = buffer(max_size, dtype=torch.long)
        self.positions = buffer(max_size, dtype=torch.long)
        self.slot_mapping = buffer(max_size, dtype=torch.int64, fill=-1)
        self.seq_lens = buffer(max_size, dtype=torch.int32, fill=1)
        self.block_tables = buffer(max_size, max_blocks, dtype=torch.int32)
        # One token per row: fixed for good.
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(max_size, dtype=torch.long, device=device)
        start = time.perf_counter()
        pool = graph_type.new_pool()
        self.graphs: dict[int, Graph] = {}
        for size in reversed(self.batch_sizes):
            self.graphs[size] = graph_type(functools.partial(forward, *self._inputs(size)), pool)
        logger.info("decode graphs for batch sizes %s captured in %.1f s", self.batch_sizes,
                    time.perf_counter() - start)

    def _inputs(self, size: int) -> tuple:
        """The first `size` rows of the buffers, as the model's forward takes them."""
        meta = AttentionMetadata(
            num_decodes=size, query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
            max_query_len=1, max_seq_len=self.max_model_len)
        return self.input_ids[:size], self.positions[:size], meta, self.logits_indices[:size]

    def bucket_for(self, meta: AttentionMetadata) -> int | None:
        """The smallest captured size that holds this step; None: the step runs eagerly."""
        num_seqs = meta.num_seqs
        if (meta.num_decodes != num_seqs or num_seqs > self.batch_sizes[-1]
                or meta.max_seq_len > self.max_model_len or meta.block_tables.shape[1] > self.block_tables.shape[1]):
            return None
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_seqs)]

    def run(self, batch: StepBatch) -> torch.Tensor | None:
        """The logits at batch.logits_indices, from a graph replay; None when no graph fits."""
        size = self.bucket_for(batch.meta)
        if size is None:
            return None
        self._load(batch, size)
        graph = self.graphs[size]
        graph.replay()
        # One token per row, so token indices are row indices; padding rows come after them.
        return graph.output[batch.logits_indices]

    def _load(self, batch: StepBatch, size: int) -> None:
        meta, n = batch.meta, batch.meta.num_seqs
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        # Rows n..size may hold an earlier step's request: make them padding again. Their
        # token ids, positions and block ids stay stale but valid, which is all a pad row needs
        # (the table's columns past a row's length are never read either).
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].fill_(1)


class NoDecodeGraphs:
    """Before capture_decode_graphs (or without CUDA graphs): every step runs eagerly."""

    def __init__(self):
        self.graphs: dict[int, Graph] = {}

    def run(self, batch: StepBatch) -> None:
        return None
