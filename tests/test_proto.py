"""The committed generated gRPC code matches proto/ (run `make proto` when this fails)."""
from __future__ import annotations

import filecmp
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_generated_code_is_fresh(tmp_path):
    subprocess.run([sys.executable, os.path.join(ROOT, "proto", "generate.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    committed = os.path.join(ROOT, "services", "pb")
    names = sorted(n for n in os.listdir(tmp_path) if not n.startswith("__pycache__"))
    assert names == sorted(n for n in os.listdir(committed) if n != "__pycache__")
    _, mismatch, errors = filecmp.cmpfiles(tmp_path, committed, names, shallow=False)
    assert not mismatch and not errors, f"stale generated code: {mismatch or errors}; run `make proto`"


def test_every_message_roundtrips():
    from pdserve.services.pb import decode_pb2, kvstore_pb2, router_pb2
    req = router_pb2.GenerateRequest(req_id="r", text="hi", slo_class="batch")
    req.sampling.max_tokens = 4
    assert router_pb2.GenerateRequest.FromString(req.SerializeToString()) == req
    assert req.WhichOneof("prompt") == "text" and req.sampling.HasField("max_tokens")
    assert not req.sampling.HasField("temperature")
    block = kvstore_pb2.KVBlock(data=b"\x00" * 8, found=True)
    block.header.shape.extend([2, 2, 16, 3, 64])
    assert kvstore_pb2.KVBlock.FromString(block.SerializeToString()).header.shape == [2, 2, 16, 3, 64]
    dec = decode_pb2.DecodeRequest(first_token_id=0)
    assert dec.HasField("first_token_id")


def test_contracts_point_one_way():
    """A callee's contract imports only common.proto, never its caller's: the workers' and
    the kvstore's files know nothing of the router's."""
    from pdserve.services.pb import decode_pb2, kvstore_pb2, prefill_pb2
    for module in (decode_pb2, prefill_pb2, kvstore_pb2):
        deps = {d.name for d in module.DESCRIPTOR.dependencies}
        assert deps <= {"pdserve/v1/common.proto"}, f"{module.DESCRIPTOR.name} imports {deps}"
    assert decode_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].methods_by_name["Decode"].output_type.file.name \
        == "pdserve/v1/common.proto"


def test_one_name_per_thing_on_the_wire():
    """`req_id` and `num_*` counts, as the engine names them (STYLE.md)."""
    from pdserve.services.pb import common_pb2, decode_pb2, kvstore_pb2, prefill_pb2, router_pb2
    fields = {f.name for module in (common_pb2, decode_pb2, kvstore_pb2, prefill_pb2, router_pb2)
              for message in module.DESCRIPTOR.message_types_by_name.values() for f in message.fields}
    assert "req_id" in fields and "request_id" not in fields
    load = {f.name for f in common_pb2.WorkerLoad.DESCRIPTOR.fields}
    assert {"num_queued_prefill_tokens", "num_free_kv_blocks", "num_total_kv_blocks"} <= load
