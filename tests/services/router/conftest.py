"""Fixtures for the router's tests: the tiny model's tokenizer (loaded once) and a
cluster of fake workers behind a real router."""
from __future__ import annotations

import pytest

from pdserve.engine import load_tokenizer
from pdserve.services.router.client import RouterClient
from tests.services.router.fakes import start_fake_cluster


@pytest.fixture(scope="session")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)


@pytest.fixture
def make_cluster(tiny_llama_dir, tokenizer):
    """make_cluster(num_prefill=2, num_decode=2, **RouterConfig overrides) -> FakeCluster."""
    started = []

    def make(**kwargs):
        cluster = start_fake_cluster(tiny_llama_dir, tokenizer, **kwargs)
        started.append(cluster)
        return cluster
    yield make
    for cluster in started:
        cluster.stop()


@pytest.fixture
def cluster(make_cluster):
    return make_cluster()


@pytest.fixture
def client(cluster):
    c = RouterClient(cluster.router.address)
    yield c
    c.close()

