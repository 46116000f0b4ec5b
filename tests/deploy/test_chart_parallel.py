"""Tensor and pipeline parallel worker pools: prefill/decode.tensorParallelSize and
pipelineParallelSize reach the workers' command lines, the pod asks for gpus x t x p GPUs,
and gets a memory-backed /dev/shm whenever it runs on GPUs or runs more than one rank."""
from __future__ import annotations

import pytest

from pdserve.cli.main import build_parser
from tests.deploy.chart import FULLNAME, container, expand_env, render, render_error

SCHEMA = "values don't meet the specifications of the schema"
CLI = build_parser()


def _pool(m, pool: str) -> tuple[dict, dict]:
    """(the pool's container, its pod spec)."""
    deployment = m.get("Deployment", f"{FULLNAME}-{pool}")
    return container(deployment), deployment["spec"]["template"]["spec"]


def _sizes(c: dict) -> tuple[int, int]:
    """(t, p) as the pod's `pdserve` reads its args."""
    args = CLI.parse_args(expand_env(c["args"], c.get("env", [])))
    return args.tensor_parallel_size, args.pipeline_parallel_size


def _shm(c: dict, spec: dict) -> str | None:
    """The sizeLimit of the memory-backed volume on /dev/shm; None: none."""
    mount = next((v["name"] for v in c["volumeMounts"] if v["mountPath"] == "/dev/shm"), None)
    volume = next((v for v in spec["volumes"] if v["name"] == mount), None)
    if volume is None:
        return None
    assert volume["emptyDir"]["medium"] == "Memory"
    return volume["emptyDir"]["sizeLimit"]


def test_the_defaults_run_one_rank_per_pod():
    for pool in ("prefill", "decode"):
        c, spec = _pool(render("default"), pool)
        assert _sizes(c) == (1, 1)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert _shm(c, spec) == "2Gi"  # on a GPU: NCCL and torch need more than the runtime's 64 MiB


def test_each_pool_gets_its_sizes_and_gpus_x_t_x_p_gpus():
    m = render("default", sets=("prefill.tensorParallelSize=3", "prefill.pipelineParallelSize=2",
                                "decode.tensorParallelSize=2", "decode.gpus=2"))
    prefill, prefill_spec = _pool(m, "prefill")
    decode, decode_spec = _pool(m, "decode")
    assert _sizes(prefill) == (3, 2) and prefill["resources"]["limits"]["nvidia.com/gpu"] == 6
    assert _sizes(decode) == (2, 1) and decode["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert (_shm(prefill, prefill_spec), _shm(decode, decode_spec)) == ("12Gi", "4Gi")
    # the other resources stay as the values give them
    assert prefill["resources"]["requests"] == {"cpu": "4", "memory": "32Gi"}


def test_the_values_win_over_extra_args():
    """The GPU count comes from the values: a size in extraArgs must not contradict it."""
    m = render("default", sets=("prefill.tensorParallelSize=2", "prefill.extraArgs={--tensor-parallel-size=4}"))
    c, _ = _pool(m, "prefill")
    assert _sizes(c) == (2, 1) and c["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_shared_memory_only_where_needed_on_cpu():
    m = render("cpu", sets=("decode.pipelineParallelSize=2",))
    prefill, prefill_spec = _pool(m, "prefill")
    decode, decode_spec = _pool(m, "decode")
    assert _shm(prefill, prefill_spec) is None  # one rank, no GPU: the runtime's default is enough
    assert _shm(decode, decode_spec) == "4Gi"   # two ranks on the CPU
    assert _sizes(decode) == (1, 2)
    assert "nvidia.com/gpu" not in decode["resources"].get("limits", {})


@pytest.mark.parametrize("value", ["prefill.tensorParallelSize=0", "decode.pipelineParallelSize=0",
                                   "decode.tensorParallelSize=-2", "prefill.pipelineParallelSize=1.5",
                                   "prefill.tensorParallelSize=two"])
def test_the_schema_refuses_sizes_below_one_or_not_integers(value):
    error = render_error(value)
    where = "/" + value.split("=")[0].replace(".", "/")
    assert SCHEMA in error and where in error, error
