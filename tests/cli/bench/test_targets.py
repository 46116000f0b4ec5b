"""The bench's gRPC target authenticates as the OpenAI one does: --api-key (or
$PDSERVE_API_KEY) reaches the router; the OpenAI client's placeholder sends nothing."""
from __future__ import annotations

import pdserve.services.router.client
from pdserve.cli.bench.targets import GrpcTarget, TargetConfig


class _Recorder:
    def __init__(self, address, api_key=None, tls=None):
        self.address, self.api_key = address, api_key


def test_the_grpc_target_sends_the_api_key_and_no_placeholder(monkeypatch):
    monkeypatch.setattr(pdserve.services.router.client, "RouterClient", _Recorder)
    assert GrpcTarget(TargetConfig(url="127.0.0.1:1", api_key="key-a")).client.api_key == "key-a"
    assert GrpcTarget(TargetConfig(url="127.0.0.1:1")).client.api_key is None
