"""services/common/address.py: the one host:port parser of flags and config fields."""
from __future__ import annotations

import pytest

from pdserve.services.common.address import parse_addresses, split_host_port


def test_split_host_port():
    assert split_host_port("127.0.0.1:50060", "address") == ("127.0.0.1", 50060)
    assert split_host_port("[::1]:8000", "address") == ("::1", 8000)
    assert split_host_port("kvstore.ns.svc:1", "address") == ("kvstore.ns.svc", 1)


@pytest.mark.parametrize("bad", ["nohost", ":80", "host:", "host:http", "host:0", "host:65536"])
def test_a_bad_address_names_its_field(bad):
    with pytest.raises(ValueError, match=rf"^ucx_address: '{bad}' is not host:port$"):
        split_host_port(bad, "ucx_address")


def test_flag_lists_are_split_checked_and_kept_as_written():
    assert parse_addresses(["[::1]:1, b:2", "", "b:2"]) == ("[::1]:1", "b:2")
    assert parse_addresses(None) == ()
    with pytest.raises(ValueError, match="^worker address: 'b:99999'"):
        parse_addresses(["a:1,b:99999"])
