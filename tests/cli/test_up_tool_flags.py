"""`pdserve up --tool-call-parser --enable-auto-tool-choice --reasoning-parser` (vLLM's flags):
checked before anything starts, then on the router's command line, which its own parser reads
into the HTTP API's config."""
from __future__ import annotations

import pytest

import pdserve.cli.main
import pdserve.cli.up
from pdserve.cli.launcher import PlatformConfig, plan
from pdserve.services.router.main import http_config_from_args

PARSER = pdserve.cli.main.build_parser()


def _router_config(monkeypatch, *argv: str):
    seen: list[PlatformConfig] = []
    monkeypatch.setattr(pdserve.cli.up, "run_platform", lambda cfg: seen.append(cfg) or 0)
    assert pdserve.cli.main.main(["up", *argv]) == 0
    [router] = [s for s in plan(seen[0], [0, 1, 2]) if s.name == "router"]
    return http_config_from_args(PARSER.parse_args(router.argv[router.argv.index("pdserve.cli.main") + 1:]))


def test_the_flags_reach_the_router(monkeypatch):
    http = _router_config(monkeypatch, "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                          "--reasoning-parser", "deepseek_r1")
    assert (http.tool_call_parser, http.enable_auto_tool_choice, http.reasoning_parser) == (
        "hermes", True, "deepseek_r1")


def test_by_default_nothing_is_parsed(monkeypatch):
    http = _router_config(monkeypatch)
    assert (http.tool_call_parser, http.enable_auto_tool_choice, http.reasoning_parser) == (None, False, None)


def test_a_parser_without_auto_tool_choice_is_passed_alone(monkeypatch):
    http = _router_config(monkeypatch, "--tool-call-parser", "pythonic")
    assert (http.tool_call_parser, http.enable_auto_tool_choice) == ("pythonic", False)


def test_auto_tool_choice_without_a_parser_stops_up_before_anything_starts(monkeypatch, capsys):
    monkeypatch.setattr(pdserve.cli.up, "run_platform", lambda cfg: pytest.fail("started"))
    assert pdserve.cli.main.main(["up", "--enable-auto-tool-choice"]) == 2
    assert "enable_auto_tool_choice: needs a tool_call_parser" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--tool-call-parser", "nope"), ("--reasoning-parser", "nope")])
def test_an_unknown_parser_is_refused_naming_the_flag(capsys, flag, value):
    for command in ("up", "router"):
        with pytest.raises(SystemExit) as e:
            PARSER.parse_args([command, flag, value])
        assert e.value.code == 2 and flag in capsys.readouterr().err


def test_the_router_refuses_auto_tool_choice_without_a_parser():
    with pytest.raises(ValueError, match="^enable_auto_tool_choice: needs a tool_call_parser"):
        http_config_from_args(PARSER.parse_args(["router", "--decode", "127.0.0.1:1", "--enable-auto-tool-choice"]))
