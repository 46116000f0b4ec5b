"""One in-test cluster for this folder: kvstore, a prefill and a decode worker on the tiny
model, and the router with gRPC and its HTTP API, all on free loopback ports."""
from __future__ import annotations

import pytest
import torch

from engine.model.loader import load_model
from engine.model.source import resolve_model
from services.common.worker import WorkerConfig
from services.decode.server import serve as serve_decode
from services.kvstore.server import KVStoreConfig
from services.kvstore.server import serve as serve_kvstore
from services.prefill.server import serve as serve_prefill
from tests.services.cluster import Cluster
from tests.services.openai.support import start_router


@pytest.fixture(scope="package")
def tiny(tiny_llama_dir):
    return load_model(resolve_model(tiny_llama_dir), torch.float32, "cpu", progress=False)


@pytest.fixture(scope="package")
def bench_cluster(tiny, tiny_llama_dir):
    cluster = Cluster(serve_kvstore(KVStoreConfig(capacity_bytes=64 << 20, metrics_port=None)))
    try:
        cfg = WorkerConfig(model=tiny_llama_dir, kvstore_address=cluster.kvstore.address, metrics_port=None,
                           kv_cache_memory_bytes=8 << 20)
        cluster.prefills = [serve_prefill(cfg, tiny)]
        cluster.decodes = [serve_decode(cfg, tiny)]
        cluster.router = start_router(cluster, tiny_llama_dir, tiny.tokenizer)
    except Exception:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()
