"""`pdserve kvstore` (services/kvstore/main.py): arguments, a real process on the Redis
backend with UCX over TCP, stopped by SIGTERM; and two replicas sharing one Redis."""
from __future__ import annotations

import argparse
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time

import pytest
import redis

from pdserve.services.kvstore.client import KVStoreClient
from pdserve.services.kvstore.main import add_arguments, parse_bytes, run
from pdserve.services.kvstore.server import KVStoreConfig, serve
from tests.services.kvstore.conftest import free_port, h, wire_block

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve kvstore")
    add_arguments(p)
    return p


@pytest.mark.parametrize("text,expected", [("4096", 4096), ("2GiB", 2 << 30), ("512MiB", 512 << 20),
                                           ("1.5GB", 1_500_000_000), ("64 kib", 65536), ("3TB", 3 * 10**12)])
def test_sizes_accept_suffixes(text, expected):
    assert parse_bytes(text) == expected


def test_defaults():
    args = parser().parse_args([])
    assert (args.host, args.port, args.metrics_port, args.capacity_bytes, args.backend, args.ucx_port,
            args.tcp_port) == ("127.0.0.1", 50060, None, 1 << 30, "memory", None, None)


@pytest.mark.parametrize("argv,flag", [
    (["--capacity-bytes", "2XB"], "--capacity-bytes"),
    (["--capacity-bytes", "0"], "--capacity-bytes"),
    (["--capacity-bytes", "-5MiB"], "--capacity-bytes"),
    (["--port", "70000"], "--port"),
    (["--metrics-port", "http"], "--metrics-port"),
    (["--ucx-port", "-1"], "--ucx-port"),
    (["--tcp-port", "70000"], "--tcp-port"),
    (["--backend", "ftp://x"], "--backend"),
    (["--lease-ttl-ms", "0"], "--lease-ttl-ms"),
])
def test_a_bad_argument_names_its_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(argv)
    assert exit_.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_an_unreachable_redis_is_a_clear_error(capsys):
    args = parser().parse_args(["--port", "0", "--backend", f"redis://127.0.0.1:{free_port()}/0"])
    assert run(args) == 1
    err = capsys.readouterr().err
    assert "cannot start" in err and "redis" in err


def test_a_taken_port_is_a_clear_error(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = parser().parse_args(["--port", str(taken.getsockname()[1])])
        assert run(args) == 1
    assert "cannot start" in capsys.readouterr().err


def _read_line(proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    """The process's next stdout line; fails if none comes (it died, or hangs)."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while not sel.select(timeout=0.1):
            assert proc.poll() is None, f"kvstore exited with {proc.returncode}: {proc.stderr.read()}"
            assert time.monotonic() < deadline, "kvstore printed nothing"
    return proc.stdout.readline()


def test_the_command_serves_redis_over_ucx_and_stops_on_sigterm(redis_url):
    url = redis_url.rsplit("/", 1)[0] + "/1"
    redis.Redis.from_url(url).flushdb()
    env = {**os.environ, "UCX_TLS": "tcp"}  # across processes over TCP, as between machines
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.services.kvstore.main", "--port", "0", "--ucx-port", "0",
                             "--metrics-port", "0", "--capacity-bytes", "1MiB", "--backend", url],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = _read_line(proc)
        address = re.search(r"serving on (\S+),", banner).group(1)
        assert re.search(r"ucx 127\.0\.0\.1:\d+", banner) and "backend redis://" in banner
        client = KVStoreClient(address, transport="ucx")
        try:
            lease = client.create_lease(10_000)
            assert client.put([wire_block(b"a", fill=7), wire_block(tail="r/tail")], lease_id=lease) == 2
            got = client.get([h(b"a")], ["r/tail"])
            assert [b.found for b in got] == [True, True] and got[0].data == wire_block(b"a", fill=7).data
            assert client.release_lease(lease, drop_tail=True)
            assert client.stats().num_blocks == 1
        finally:
            client.close()
        assert redis.Redis.from_url(url).exists(b"pdserve:kv:b:h:" + h(b"a")) == 1  # the bytes live in Redis
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "kvstore stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_two_replicas_share_one_redis(redis_url):
    url = redis_url.rsplit("/", 1)[0] + "/2"
    redis.Redis.from_url(url).flushdb()
    replicas = [serve(KVStoreConfig(backend=url, capacity_bytes=1 << 20, metrics_port=None)) for _ in range(2)]
    a, b = (KVStoreClient(r.address) for r in replicas)
    try:
        lease = a.create_lease(10_000)
        a.put([wire_block(b"x"), wire_block(tail="req/tail")], lease_id=lease)
        assert b.lookup([h(b"x")]) == 1
        assert [blk.found for blk in b.get([h(b"x")], ["req/tail"])] == [True, True]
        assert b.stats().num_pinned_blocks == 2
        assert b.release_lease(lease, drop_tail=True) is True   # a lease made on one, released on the other
        assert a.release_lease(lease, drop_tail=True) is False
        assert a.stats().num_blocks == 1 and a.stats().num_hits == 2
    finally:
        a.close()
        b.close()
        for r in replicas:
            r.stop()


@pytest.mark.parametrize("overrides,field", [
    ({"capacity_bytes": 0}, "capacity_bytes"),
    ({"default_lease_ttl_ms": 0}, "default_lease_ttl_ms"),
    ({"default_lease_ttl_ms": 700_000}, "default_lease_ttl_ms"),
    ({"port": 65536}, "port"),
    ({"ucx_port": -1}, "ucx_port"),
    ({"backend": "memcached://x"}, "backend"),
])
def test_config_refuses_bad_values_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        KVStoreConfig(**overrides)
