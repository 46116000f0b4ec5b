"""One in-test cluster for this folder: kvstore, a prefill and a decode worker on the tiny
model, and the router with gRPC and its HTTP API, all on free loopback ports."""
from __future__ import annotations

import pytest

from tests.services.router.fronts.http.support import start_http_cluster


@pytest.fixture(scope="package")
def bench_cluster(tiny, tiny_llama_dir):
    cluster = start_http_cluster(tiny, tiny_llama_dir)
    yield cluster
    cluster.stop()
