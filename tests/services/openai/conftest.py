"""One in-test cluster for this folder (kvstore, a prefill and a decode worker, the router
with its HTTP API on a free loopback port) and the offline engine on the same weights,
which every answer is compared with."""
from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.model.loader import load_model
from engine.model.source import resolve_model
from services.common.worker import WorkerConfig
from services.decode.server import serve as serve_decode
from services.kvstore.server import KVStoreConfig
from services.kvstore.server import serve as serve_kvstore
from services.prefill.server import serve as serve_prefill
from tests.services.cluster import Cluster
from tests.services.openai.support import start_router, sync_client
from tests.services.test_disaggregated import assert_nothing_leaked


@pytest.fixture(scope="package")
def tiny(tiny_llama_dir):
    return load_model(resolve_model(tiny_llama_dir), torch.float32, "cpu", progress=False)


@pytest.fixture(scope="package")
def llm(tiny, tiny_llama_dir):
    return LLM(tiny_llama_dir, loaded_model=tiny, progress=False)


@pytest.fixture(scope="package")
def shared_cluster(tiny, tiny_llama_dir):
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


@pytest.fixture
def cluster(shared_cluster):
    """The shared cluster; after each test every block is free and no lease is left."""
    yield shared_cluster
    assert_nothing_leaked(shared_cluster)


@pytest.fixture
def model(shared_cluster) -> str:
    """The served model's name, as /v1/models reports it."""
    return shared_cluster.router.servicer.model.name


@pytest.fixture
def tokenizer(tiny):
    return tiny.tokenizer


@pytest.fixture
def client(cluster):
    with sync_client(cluster.router) as c:
        yield c
