"""`<pool>.gpuMemoryUtilization` and `router.servedModelName`: rendered as the workers'
--gpu-memory-utilization and the router's and workers' --served-model-name, which `pdserve` parses; the
schema refuses what the flags would."""
from __future__ import annotations

import pytest
import yaml

from pdserve.cli.main import build_parser
from tests.deploy.chart import FULLNAME, Manifests, container, render, render_error, render_text

CLI = build_parser()
SCHEMA = "values don't meet the specifications of the schema"


def _args(m: Manifests, component: str):
    return CLI.parse_args(container(m.get("Deployment", f"{FULLNAME}-{component}"))["args"])


def _render_values(tmp_path, values: dict) -> Manifests:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return Manifests([d for d in yaml.safe_load_all(render_text(extra_files=(path,))) if d])


def test_both_pools_default_to_vllm_s_0_9():
    m = render()
    for pool in ("prefill", "decode"):
        assert "--gpu-memory-utilization=0.9" in container(m.get("Deployment", f"{FULLNAME}-{pool}"))["args"]
        assert _args(m, pool).gpu_memory_utilization == 0.9


def test_each_pool_gets_its_own(tmp_path):
    m = _render_values(tmp_path, {"prefill": {"gpuMemoryUtilization": 0.8}, "decode": {"gpuMemoryUtilization": 0.55}})
    assert (_args(m, "prefill").gpu_memory_utilization, _args(m, "decode").gpu_memory_utilization) == (0.8, 0.55)


def test_extra_args_still_have_the_last_word():
    m = render(sets=("decode.extraArgs={--gpu-memory-utilization=0.7}",))
    assert _args(m, "decode").gpu_memory_utilization == 0.7


@pytest.mark.parametrize("value,where", [("0", "exclusiveMinimum"), ("2", "maximum")])
def test_the_schema_refuses_a_share_outside_zero_to_one(value, where):
    error = render_error(f"prefill.gpuMemoryUtilization={value}")
    assert SCHEMA in error and "/prefill/gpuMemoryUtilization" in error and where in error, error


def test_no_served_name_by_default():
    m = render()
    assert not any(a.startswith("--served-model-name") for a in container(
        m.get("Deployment", f"{FULLNAME}-router"))["args"])
    for component in ("router", "prefill", "decode"):
        assert _args(m, component).served_model_name == [], component


@pytest.mark.parametrize("sets,names", [
    (("router.servedModelName=llama-3-8b",), ("llama-3-8b",)),
    (("router.servedModelName={llama-3-8b,llama}",), ("llama-3-8b", "llama")),
])
def test_served_names_reach_the_router_and_the_workers(sets, names):
    m = render(sets=sets)
    # the workers: the first is the model_name label of their vllm: metrics
    for component in ("router", "prefill", "decode"):
        assert tuple(_args(m, component).served_model_name) == names, component


def test_the_schema_refuses_an_empty_name():
    error = render_error("router.servedModelName=")
    assert SCHEMA in error and "/router/servedModelName" in error, error


def test_model_quantization_reaches_every_worker_not_the_router():
    assert all(_args(render(), pool).quantization is None for pool in ("prefill", "decode"))
    m = render(sets=("model.quantization=gguf",))
    assert (_args(m, "prefill").quantization, _args(m, "decode").quantization) == ("gguf", "gguf")
    assert not any("quantization" in a for a in container(m.get("Deployment", f"{FULLNAME}-router"))["args"])


def test_the_schema_refuses_a_quantization_the_workers_do_not_serve():
    error = render_error("model.quantization=awq")
    assert SCHEMA in error and "/model/quantization" in error, error
