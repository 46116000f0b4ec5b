import argparse

import pytest

from pdserve.services.common.numbers import number_arg, port_arg


def _refusal(parse, text: str) -> str:
    with pytest.raises(argparse.ArgumentTypeError) as e:
        parse(text)
    return str(e.value)


@pytest.mark.parametrize("text,value", [("1", 1), ("7", 7), ("+3", 3), (" 12 ", 12)])
def test_an_integer_within_its_bound_is_parsed(text, value):
    parsed = number_arg(int, low=1)(text)
    assert parsed == value and type(parsed) is int


@pytest.mark.parametrize("text", ["0", "-1", "1.5", "1e3", "", "one", "nan"])
def test_an_integer_below_its_bound_or_not_an_integer_is_refused(text):
    assert _refusal(number_arg(int, low=1), text) == f"must be an integer >= 1, got {text!r}"


@pytest.mark.parametrize("text,ok", [("0", True), ("1e-9", True), ("0.5", True), ("1", False), ("1.0", False)])
def test_a_half_open_range_takes_its_closed_end_and_the_inside(text, ok):
    parse = number_arg(float, low=0, high=1, high_open=True)  # [0, 1)
    if ok:
        assert parse(text) == float(text)
    else:
        assert _refusal(parse, text) == f"must be a number in [0, 1), got {text!r}"


def test_open_and_closed_bounds_are_exact():
    half_open = number_arg(float, "", low=0, low_open=True, high=1)  # (0, 1]
    assert half_open("1") == 1.0 and half_open("1e-12") == 1e-12
    assert _refusal(half_open, "0") == "must be in (0, 1], got '0'"
    assert _refusal(half_open, "1.0000001") == "must be in (0, 1], got '1.0000001'"
    closed_open = number_arg(int, low=0, high=10, high_open=True)  # [0, 10)
    assert closed_open("0") == 0 and closed_open("9") == 9
    assert _refusal(closed_open, "10") == "must be an integer in [0, 10), got '10'"
    assert _refusal(number_arg(int, high=5), "6") == "must be an integer <= 5, got '6'"
    assert _refusal(number_arg(int, high=5, high_open=True), "5") == "must be an integer < 5, got '5'"


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e999", "NaN", "ten"])
def test_a_float_must_be_finite_even_without_bounds(text):
    assert _refusal(number_arg(float), text) == f"must be a number, got {text!r}"


def test_the_message_carries_the_meaning_the_note_and_the_field():
    ms = number_arg(float, "a number of milliseconds", low=0, note="0: no time bound")
    assert ms("0") == 0.0 and ms("2.5") == 2.5
    assert _refusal(ms, "-1") == "must be a number of milliseconds >= 0 (0: no time bound), got '-1'"
    fraction = number_arg(float, "", low=0, low_open=True, high=1, field="gpu_memory_utilization")
    assert _refusal(fraction, "2") == "gpu_memory_utilization: must be in (0, 1], got '2'"
    assert _refusal(number_arg(float, low=0.5), "0.25") == "must be a number >= 0.5, got '0.25'"
    assert _refusal(number_arg(int, low=1_000_000), "5") == "must be an integer >= 1000000, got '5'"


@pytest.mark.parametrize("text,ok", [("0", True), ("65535", True), ("65536", False), ("-1", False), ("http", False)])
def test_a_port_is_0_to_65535(text, ok):
    port = port_arg(note="0: a free one")
    if ok:
        assert port(text) == int(text)
    else:
        assert _refusal(port, text) == f"must be a port number in [0, 65535] (0: a free one), got {text!r}"


def test_only_int_and_float_are_number_kinds():
    with pytest.raises(TypeError, match="kind must be int or float"):
        number_arg(str)


def test_argparse_names_the_flag_in_front_of_the_message(capsys):
    parser = argparse.ArgumentParser()
    parser.add_argument("--lease-ttl-ms", type=number_arg(int, "a number of milliseconds", low=0, low_open=True))
    assert parser.parse_args(["--lease-ttl-ms", "5"]).lease_ttl_ms == 5
    with pytest.raises(SystemExit):
        parser.parse_args(["--lease-ttl-ms", "0"])
    assert "argument --lease-ttl-ms: must be a number of milliseconds > 0, got '0'" in capsys.readouterr().err
