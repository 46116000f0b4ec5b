"""One in-test cluster for this folder (kvstore, a prefill and a decode worker, the router
with its HTTP API on a free loopback port) and the offline engine on the same weights,
which every answer is compared with."""
from __future__ import annotations

import pytest

from pdserve.engine import LLM
from tests.services.router.fronts.http.support import start_http_cluster, sync_client
from tests.services.test_disaggregated import assert_nothing_leaked


@pytest.fixture(scope="package")
def llm(tiny, tiny_llama_dir):
    return LLM(tiny_llama_dir, loaded_model=tiny, progress=False)


@pytest.fixture(scope="package")
def shared_cluster(tiny, tiny_llama_dir):
    cluster = start_http_cluster(tiny, tiny_llama_dir)
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
