"""What a machine needs before any check starts: CUDA (or --dry-run / --cpu-logic), the
packages the checks import, and pdserve's own modules importing with them."""
from __future__ import annotations

import importlib
import importlib.util

# What the checks import, top-level module -> distribution (for the message when one is missing):
# the engine and kernels, the four services `pdserve up` starts and the router client (traced over
# --cpu-logic; bench/gpu_check_wheels.sh downloads the ones the device machine lacks).
REQUIRED_MODULES = {
    "torch": "torch", "triton": "triton", "transformers": "transformers", "tokenizers": "tokenizers",
    "safetensors": "safetensors", "numpy": "numpy", "tqdm": "tqdm", "jinja2": "jinja2", "yaml": "pyyaml",
    "grpc": "grpcio", "google.protobuf": "protobuf", "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection", "prometheus_client": "prometheus-client", "kubernetes": "kubernetes",
    "pydantic": "pydantic", "pydantic_core": "pydantic-core", "dateutil": "python-dateutil",
    "requests_oauthlib": "requests-oauthlib", "websocket": "websocket-client", "durationpy": "durationpy",
    "fastapi": "fastapi", "starlette": "starlette", "uvicorn": "uvicorn", "click": "click", "h11": "h11",
    "anyio": "anyio", "annotated_doc": "annotated-doc", "opentelemetry": "opentelemetry-api",
}
# Imported once here, so a version mismatch (services/pb's generated code checks grpcio and
# protobuf) shows before any check starts.
PROJECT_MODULES = ("pdserve.engine", "pdserve.kernels.paged_attention", "pdserve.services.pb.router_pb2_grpc", "pdserve.services.kvstore.main",
                   "pdserve.services.prefill.main", "pdserve.services.decode.main", "pdserve.services.router.main", "pdserve.services.router.server",
                   "pdserve.services.router.client",
                   "pdserve.cli.up")
DEVICE_COMMAND = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
                  "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && "
                  "python3 -m bench.gpu_check --out $OUT")


def cuda_status() -> tuple[bool, str]:
    """Whether CUDA is usable, and torch's version line. Creates no CUDA context here: the
    checks' own processes use the GPU."""
    import torch
    cuda = torch.version.cuda or "none (a CPU build of torch)"
    return torch.cuda.is_available(), f"torch {torch.__version__}, cuda {cuda}"


def missing_packages() -> list[str]:
    """'distribution (why)' for each thing the checks import that is missing or unusable here."""
    problems = []
    for module, dist in REQUIRED_MODULES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            problems.append(f"{dist} (no module {module})")
    if problems:
        return problems
    for module in PROJECT_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as e:
            name = (e.name or "").split(".")[0]
            dist = next((d for m, d in REQUIRED_MODULES.items() if m.split(".")[0] == name), name or "?")
            problems.append(f"{dist} (importing {module}: {e})")
        except Exception as e:  # noqa: BLE001 - e.g. generated gRPC code refusing an older grpcio
            problems.append(f"{module} does not import: {type(e).__name__}: {str(e).splitlines()[0]}")
    return problems


def carry_hint() -> str:
    return ("carry them as wheels: run bench/gpu_check_wheels.sh where PyPI is reachable (it downloads "
            "them into .whl/), then on the device machine carry [\".whl\"] and run: " + DEVICE_COMMAND)

