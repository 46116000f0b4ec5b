"""The credential model's small parts, without processes: token lists, where the internal
token comes from, the bearer check, the UCX hello, the request bound, the flags, and the
token `pdserve up` hands its processes."""
from __future__ import annotations

import argparse
import logging

import pytest

from pdserve.cli.launcher import PlatformConfig, plan
from pdserve.services.common.auth import INTERNAL_TOKEN_ENV, bearer_problem, internal_token, parse_tokens
from pdserve.services.common.grpc_server import start_server
from pdserve.services.common.security import ServerSecurity, add_server_tls_arguments, server_tls_from_args
from pdserve.services.kvstore.transports.ucx import frames
from pdserve.services.router.config import max_request_bytes
from pdserve.services.router.fronts.http.config import HttpConfig


def test_a_token_list_is_comma_separated_and_has_no_empty_item():
    assert parse_tokens(" new , old ", "x") == ("new", "old")
    assert parse_tokens(None, "x") == () and parse_tokens("  ", "x") == ()
    with pytest.raises(ValueError, match="--api-key: an empty token"):
        parse_tokens("a,,b", "--api-key")
    with pytest.raises(ValueError, match="whitespace"):
        parse_tokens("a b", "x")
    with pytest.raises(ValueError, match="api_key"):
        HttpConfig(api_key="a,")


def test_the_internal_token_file_wins_over_the_environment(tmp_path):
    env = {INTERNAL_TOKEN_ENV: "from-env"}
    (tmp_path / "t").write_text("from-file\n")
    assert internal_token(str(tmp_path / "t"), env) == "from-file"
    assert internal_token(None, env) == "from-env"
    assert internal_token(None, {}) is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="internal_token_file: .* is empty"):
        internal_token(str(tmp_path / "empty"), env)
    with pytest.raises(ValueError, match="internal_token_file: cannot read"):
        internal_token(str(tmp_path / "missing"), env)


def test_the_bearer_check_takes_any_listed_token_and_nothing_else():
    tokens = ("new", "old")
    assert bearer_problem("Bearer new", tokens, "API key") is None
    assert bearer_problem(b"bearer old", tokens, "API key") is None
    assert bearer_problem(None, tokens, "API key").startswith("missing API key")
    for header in ("Bearer wrong", "Basic new", "Bearer new,old", "new", "Bearer "):
        assert bearer_problem(header, tokens, "API key") == "invalid API key", header


def test_the_ucx_hello_carries_the_token_in_a_fixed_size():
    hello = frames.hello_frame("secret")
    assert len(hello) == frames.HELLO_BYTES and frames.hello_token(hello) == b"secret"
    assert frames.hello_token(frames.hello_frame(None)) == b""
    assert frames.hello_token(frames.frame(frames.GET).ljust(frames.HELLO_BYTES, b"\0")) is None  # not a hello
    assert frames.hello_token(hello[:-1]) is None
    with pytest.raises(ValueError, match="internal token"):
        frames.hello_frame("x" * frames.HELLO_BYTES)


def test_the_public_request_bound_follows_max_model_len_unless_set():
    assert max_request_bytes(None, 1000) == 64 * 1000 + (1 << 20)
    assert max_request_bytes(None, 128_000) > 8 << 20  # a long context's prompt still fits
    assert max_request_bytes(4096, 128_000) == 4096


def test_server_tls_flags_come_in_pairs(tmp_path):
    parser = argparse.ArgumentParser()
    add_server_tls_arguments(parser, "the port")
    assert server_tls_from_args(parser.parse_args([])) is None
    with pytest.raises(ValueError, match="--tls-cert-file and --tls-key-file"):
        server_tls_from_args(parser.parse_args(["--tls-cert-file", "c.pem"]))
    with pytest.raises(ValueError, match="--tls-client-ca-file"):
        server_tls_from_args(parser.parse_args(["--tls-client-ca-file", "ca.pem"]))
    (tmp_path / "c.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="tls_cert_file: .* is not a PEM file"):
        server_tls_from_args(parser.parse_args(["--tls-cert-file", str(tmp_path / "c.pem"),
                                                "--tls-key-file", str(tmp_path / "c.pem")]))


def test_a_port_without_a_token_says_so_at_start(caplog):
    with caplog.at_level(logging.WARNING):
        open_server = start_server([], security=ServerSecurity())
        closed_server = start_server([], security=ServerSecurity(tokens=("t",)))
    open_server.stop(0)
    closed_server.stop(0)
    warnings = [r.getMessage() for r in caplog.records if "accepts any caller" in r.getMessage()]
    assert len(warnings) == 1 and str(open_server.port) in warnings[0] and "internal token" in warnings[0]


def test_pdserve_up_gives_every_process_one_fresh_token_in_its_environment():
    specs = plan(PlatformConfig(model="m", num_prefill=1, num_decode=1), [0, 1])
    tokens = {s.env[INTERNAL_TOKEN_ENV] for s in specs}
    assert len(tokens) == 1 and len(token := tokens.pop()) >= 32
    assert all(token not in " ".join(s.argv) for s in specs)  # never where `ps` shows it
    again = plan(PlatformConfig(model="m"), [0, 1])
    assert again[0].env[INTERNAL_TOKEN_ENV] != specs[0].env[INTERNAL_TOKEN_ENV]
    assert "internal_token" not in repr(PlatformConfig())
