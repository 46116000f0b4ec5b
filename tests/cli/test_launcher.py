"""`pdserve up`: the process plan."""
from __future__ import annotations

from pdserve.cli.launcher import PlatformConfig, plan, split_cpus


def test_cores_are_split_among_workers():
    assert split_cpus([0, 1], 2, None) == [[0], [1]]
    assert split_cpus([0, 1, 2, 3], 3, None) == [[0], [1], [2]]
    assert split_cpus([0, 1, 2, 3], 2, None) == [[0, 1], [2, 3]]
    assert split_cpus([0, 1], 3, 1) == [[0], [1], [0]]
    assert split_cpus([0, 1, 2, 3], 1, 2) == [[0, 1]]


def test_plan_wires_workers_to_kvstore_and_router():
    specs = plan(PlatformConfig(model="m", num_prefill=2, num_decode=1, router_port=7000, kvstore_port=7100,
                                worker_base_port=7200, metrics_base_port=7300), [0, 1, 2])
    names = [s.name for s in specs]
    assert names == ["kvstore", "prefill-0", "prefill-1", "decode-0", "router"]
    router = specs[-1].argv
    assert router[router.index("--prefill") + 1] == "127.0.0.1:7200,127.0.0.1:7201"
    assert router[router.index("--decode") + 1] == "127.0.0.1:7202"
    for worker in specs[1:4]:
        assert worker.argv[worker.argv.index("--kvstore") + 1] == "127.0.0.1:7100"
        assert worker.argv[worker.argv.index("--threads") + 1] == "1" and len(worker.cpus) == 1
    assert len({s.metrics_port for s in specs}) == len(specs)


def test_kvstore_and_router_run_on_the_prefill_cores_so_decode_cores_only_decode():
    specs = {s.name: s for s in plan(PlatformConfig(model="m", num_prefill=1, num_decode=1), [0, 1])}
    assert specs["kvstore"].cpus == specs["router"].cpus == specs["prefill-0"].cpus == [0]
    assert specs["decode-0"].cpus == [1]
    specs = {s.name: s for s in plan(PlatformConfig(model="m", num_prefill=2, num_decode=2), [0, 1, 2, 3])}
    assert specs["kvstore"].cpus == specs["router"].cpus == [0, 1]


def test_kvstore_and_router_are_left_to_the_os_without_prefill_cores_of_their_own():
    colocated = {s.name: s for s in plan(PlatformConfig(model="m", num_prefill=0, num_decode=2), [0, 1])}
    only_both = {s.name: s for s in plan(PlatformConfig(model="m", num_prefill=0, num_decode=0, num_both=2), [0, 1])}
    shared = {s.name: s for s in plan(PlatformConfig(model="m", num_prefill=1, num_decode=2), [0, 1])}  # wraps around
    for specs in (colocated, only_both, shared):
        assert specs["kvstore"].cpus == specs["router"].cpus == []
    assert shared["decode-1"].cpus == shared["prefill-0"].cpus == [0]
    # a worker of both roles decodes: beside a prefill worker, the services go to the prefill core
    beside = {s.name: s for s in plan(PlatformConfig(model="m", num_prefill=1, num_decode=0, num_both=1), [0, 1])}
    assert beside["kvstore"].cpus == beside["prefill-0"].cpus == [0] and beside["both-0"].cpus == [1]


def test_plan_without_prefill_workers_is_colocated():
    specs = plan(PlatformConfig(model="m", num_prefill=0, num_decode=2, worker_args=("--no-chunked-prefill",)),
                 [0, 1])
    assert [s.name for s in specs] == ["kvstore", "decode-0", "decode-1", "router"]
    assert "--prefill" not in specs[-1].argv
    assert [s.cpus for s in specs[1:3]] == [[0], [1]]
    assert all(s.argv[-1] == "--no-chunked-prefill" for s in specs[1:3])


# `pdserve up` started, used and stopped with Ctrl-C: tests/cli/test_installed.py runs it as
# installed from the wheel, and tests/cli/test_make_up.py through `make up`.
