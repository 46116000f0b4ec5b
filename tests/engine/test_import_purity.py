"""The engine's pure core imports without torch, and the kvstore client without its server:
the router and the kvstore load neither. Each check runs in a fresh interpreter, since
this one has long imported everything."""
from __future__ import annotations

import json
import subprocess
import sys

PURE = ("pdserve.engine.core.scheduler", "pdserve.engine.core.block_pool", "pdserve.engine.core.kv_cache_manager", "pdserve.engine.sampling_params",
        "pdserve.engine.errors", "pdserve.engine.config", "pdserve.engine.dtypes", "pdserve.engine.request", "pdserve.engine.stats", "pdserve.engine.info",
        "pdserve.engine.core.prefill_order", "pdserve.engine.step_rates")
KVSTORE_SERVER = ("pdserve.services.kvstore.server", "pdserve.services.kvstore.grpc_servicer", "pdserve.services.kvstore.handlers")


def loaded_after(*modules: str) -> set[str]:
    """The modules in sys.modules after a fresh interpreter imports `modules`."""
    code = f"import json, sys\nimport {', '.join(modules)}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out))


def test_the_pure_core_imports_without_torch():
    assert "torch" not in loaded_after(*PURE)


def test_the_engine_core_does_load_torch():
    # the check above could pass by accident (say, torch renamed); this one says it can fail
    assert "torch" in loaded_after("pdserve.engine.engine_core")


def test_the_public_names_still_import_from_the_package():
    code = ("import sys, pdserve.engine as engine\n"
            "assert 'torch' not in sys.modules\n"
            "from pdserve.engine import LLM, SamplingParams, EngineCore, InvalidRequestError, ModelLoadError, "
            "load_tokenizer, describe_model, ModelDescription, RequestOutput, EngineConfig\n"
            "assert 'torch' in sys.modules and set(engine.__all__) <= set(dir(engine))\n"
            "assert SamplingParams is __import__('pdserve.engine.sampling_params').engine.sampling_params.SamplingParams\n"
            "try:\n    engine.NoSuchName\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit(1)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_kvstore_client_loads_no_kvstore_server_module():
    loaded = loaded_after("pdserve.services.kvstore.client")
    assert not loaded & set(KVSTORE_SERVER)
    assert "torch" not in loaded
    assert set(KVSTORE_SERVER) <= loaded_after("pdserve.services.kvstore.server")  # the names are right


def test_the_kvstore_service_loads_no_torch():
    # it takes its dtype sizes and default port from the engine's pure modules
    assert "torch" not in loaded_after("pdserve.services.kvstore.main")
