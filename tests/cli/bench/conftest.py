"""One in-test cluster for this folder: kvstore, a prefill and a decode worker on the tiny
model, and the router with gRPC and its HTTP API, all on free loopback ports."""
from __future__ import annotations

import pytest
import torch

from engine.model.loader import load_model
from engine.model.source import resolve_model
from tests.services.router.http.support import start_http_cluster


@pytest.fixture(scope="package")
def tiny(tiny_llama_dir):
    return load_model(resolve_model(tiny_llama_dir), torch.float32, "cpu", progress=False)


@pytest.fixture(scope="package")
def bench_cluster(tiny, tiny_llama_dir):
    cluster = start_http_cluster(tiny, tiny_llama_dir)
    yield cluster
    cluster.stop()
