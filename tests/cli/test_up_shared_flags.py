"""`pdserve up` passes some flags on to the router or the workers: each is declared once, by the
service that takes it, so its type, default and help are the service's own."""
import argparse

import pytest

import pdserve.cli.up
from pdserve.cli.launcher import PlatformConfig
from pdserve.services.router.main import add_arguments as add_router_arguments
from pdserve.services.worker.config import add_worker_arguments

ROUTER_FLAGS = ("--served-model-name", "--chat-template", "--tool-call-parser", "--enable-auto-tool-choice",
                "--reasoning-parser", "--port", "--http-port", "--path-policy", "--short-prompt-tokens")
WORKER_FLAGS = ("--model", "--revision", "--gpu-memory-utilization", "--kv-offloading-size", "--speculative-config")
POOL_FLAGS = {f"--{pool}-{size}-parallel-size": f"--{size}-parallel-size"
              for pool in ("prefill", "decode") for size in ("tensor", "pipeline")}


def _actions(add) -> dict[str, argparse.Action]:
    parser = argparse.ArgumentParser()
    add(parser)
    return {flag: action for action in parser._actions for flag in action.option_strings}  # noqa: SLF001


UP = _actions(pdserve.cli.up.add_arguments)


def _same(mine: argparse.Action, theirs: argparse.Action) -> bool:
    return (mine.type, mine.default, mine.help, mine.choices, mine.metavar, mine.nargs) == (
        theirs.type, theirs.default, theirs.help, theirs.choices, theirs.metavar, theirs.nargs)


@pytest.mark.parametrize("flag", ROUTER_FLAGS)
def test_a_router_flag_is_the_routers_own(flag):
    assert _same(UP[flag], _actions(add_router_arguments)[flag])


@pytest.mark.parametrize("flag", WORKER_FLAGS)
def test_a_worker_flag_is_the_decode_workers_own(flag):
    assert _same(UP[flag], _actions(lambda p: add_worker_arguments(p, default_port=0, role="decode"))[flag])


@pytest.mark.parametrize("flag,worker_flag", POOL_FLAGS.items())
def test_a_pools_parallel_size_is_the_workers_flag_under_the_pools_name(flag, worker_flag):
    pool = flag.split("-")[2]
    worker = _actions(lambda p: add_worker_arguments(p, default_port=0))[worker_flag]
    assert _same(UP[flag], worker) and UP[flag].dest == f"{pool}_{worker.dest}"


def test_the_defaults_are_the_platforms():
    args = argparse.ArgumentParser()
    pdserve.cli.up.add_arguments(args)
    parsed = args.parse_args([])
    assert (parsed.model, parsed.revision, parsed.port, parsed.http_port, parsed.path_policy,
            parsed.short_prompt_tokens, tuple(parsed.served_model_name), parsed.chat_template,
            parsed.gpu_memory_utilization, parsed.kv_offloading_size) == (
        PlatformConfig.model, PlatformConfig.revision, PlatformConfig.router_port, PlatformConfig.http_port,
        PlatformConfig.path_policy, PlatformConfig.short_prompt_tokens, PlatformConfig.served_model_names,
        PlatformConfig.chat_template, PlatformConfig.gpu_memory_utilization, PlatformConfig.kv_offloading_size)


def test_up_help_names_whose_flags_they_are(capsys):
    parser = argparse.ArgumentParser(prog="pdserve up")
    pdserve.cli.up.add_arguments(parser)
    parser.print_help()
    out = capsys.readouterr().out
    assert "the router's (see `pdserve router --help`):" in out and "every worker's" in out
    assert out.index("the router's (see") < out.index("--short-prompt-tokens SHORT_PROMPT_TOKENS\n")
