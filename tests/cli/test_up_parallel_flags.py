"""`pdserve up --{prefill,decode}-{tensor,pipeline}-parallel-size`: each pool's sizes on its
own workers' command lines (colocated decode workers take the decode ones), and cores split
so that a worker of t x p ranks gets t x p times a single-rank worker's."""
from __future__ import annotations

import argparse

import pytest

import pdserve.cli.main
import pdserve.cli.up
from pdserve.cli.launcher import PlatformConfig, plan, split_cpus, worker_ranks
from pdserve.services.worker.config import add_worker_arguments, worker_config_from_args


def _planned(monkeypatch, *argv: str) -> PlatformConfig:
    seen = []
    monkeypatch.setattr(pdserve.cli.up, "run_platform", lambda cfg: seen.append(cfg) or 0)
    assert pdserve.cli.main.main(["up", *argv]) == 0
    return seen[0]


def _sizes(argv: list[str]) -> tuple[int, int]:
    """(t, p) as the worker itself parses its command line."""
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, default_port=0)
    parallel = worker_config_from_args(parser.parse_args(argv[argv.index("pdserve.cli.main") + 2:])).engine.parallel  # after `-m pdserve.cli.main role`
    return parallel.tensor_parallel_size, parallel.pipeline_parallel_size


def test_each_pool_gets_its_own_sizes(monkeypatch):
    cfg = _planned(monkeypatch, "--prefill", "1", "--decode", "2", "--prefill-tensor-parallel-size", "3",
                   "--prefill-pipeline-parallel-size", "2", "--decode-tensor-parallel-size", "3")
    specs = {s.name: s.argv for s in plan(cfg, list(range(16)))}
    assert _sizes(specs["prefill-0"]) == (3, 2)
    assert _sizes(specs["decode-0"]) == _sizes(specs["decode-1"]) == (3, 1)


def test_colocated_decode_workers_take_the_decode_sizes(monkeypatch):
    cfg = _planned(monkeypatch, "--prefill", "0", "--decode", "1", "--prefill-tensor-parallel-size", "3",
                   "--decode-pipeline-parallel-size", "2")
    (decode,) = [s.argv for s in plan(cfg, [0, 1]) if s.name == "decode-0"]
    assert _sizes(decode) == (1, 2)


def test_defaults_add_nothing_and_leave_worker_args_standing(monkeypatch):
    cfg = _planned(monkeypatch, "--worker-args=-tp 3")
    for spec in plan(cfg, [0, 1, 2, 3]):
        assert "--tensor-parallel-size" not in spec.argv and "--pipeline-parallel-size" not in spec.argv
        if spec.name.startswith(("prefill", "decode")):
            assert _sizes(spec.argv) == (3, 1)
    # a pool's own flag comes after --worker-args, so it wins there
    cfg = _planned(monkeypatch, "--worker-args=-tp 3", "--decode-tensor-parallel-size", "1",
                   "--prefill-tensor-parallel-size", "9")
    specs = {s.name: s.argv for s in plan(cfg, [0, 1, 2, 3])}
    assert _sizes(specs["prefill-0"]) == (9, 1) and _sizes(specs["decode-0"]) == (3, 1)


@pytest.mark.parametrize("flag", ["--prefill-tensor-parallel-size", "--prefill-pipeline-parallel-size",
                                  "--decode-tensor-parallel-size", "--decode-pipeline-parallel-size"])
def test_a_bad_size_stops_up_naming_the_flag(monkeypatch, capsys, flag):
    monkeypatch.setattr(pdserve.cli.up, "run_platform", lambda cfg: pytest.fail("started"))
    with pytest.raises(SystemExit) as e:
        pdserve.cli.main.main(["up", flag, "0"])
    assert e.value.code == 2
    assert f"argument {flag}: must be an integer >= 1, got '0'" in capsys.readouterr().err


def test_a_worker_of_t_x_p_ranks_gets_t_x_p_times_the_cores(monkeypatch):
    # 12 cores, one prefill worker of 3 x 2 ranks and two single-rank decode workers: 8 shares of 1 core
    cfg = _planned(monkeypatch, "--prefill", "1", "--decode", "2", "--prefill-tensor-parallel-size", "3",
                   "--prefill-pipeline-parallel-size", "2")
    specs = {s.name: s for s in plan(cfg, list(range(12)))}
    assert specs["prefill-0"].cpus == [0, 1, 2, 3, 4, 5]
    assert specs["decode-0"].cpus == [6] and specs["decode-1"].cpus == [7]
    prefill = specs["prefill-0"].argv
    assert prefill[prefill.index("--threads") + 1] == "6"
    # --cpus-per-worker: per rank
    cfg = _planned(monkeypatch, "--prefill", "0", "--decode", "2", "--decode-tensor-parallel-size", "3",
                   "--cpus-per-worker", "2")
    assert [s.cpus for s in plan(cfg, list(range(12))) if s.name.startswith("decode")] == [
        [0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]


def test_split_by_ranks_never_repeats_a_core():
    assert split_cpus([0, 1, 2, 3, 4, 5], 2, None, [2, 1]) == [[0, 1, 2, 3], [4, 5]]
    assert split_cpus([0, 1, 2, 3], 2, None, [1, 1]) == split_cpus([0, 1, 2, 3], 2, None) == [[0, 1], [2, 3]]
    # fewer cores than ranks: each worker still gets each core once, wrapping around
    assert split_cpus([0, 1], 2, None, [3, 1]) == [[0, 1], [1]]


@pytest.mark.parametrize("argv,ranks", [
    ((), 1), (("-tp", "3"), 3), (("--tensor-parallel-size=3", "-pp=2"), 6),
    (("-tp", "3", "--tensor-parallel-size", "2"), 2),   # the last one wins, as in argparse
    (("--pipeline-parallel-size", "x"), 1),             # the worker itself refuses it
    (("--pipeline-layer-split", "3"), 1),
])
def test_worker_ranks_reads_a_command_line_as_argparse_does(argv, ranks):
    assert worker_ranks(argv) == ranks
