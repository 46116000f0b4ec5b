"""The `pdserve` command line.

Each subcommand lives in its own module (`add_arguments(parser)`, `run(args)`), imported
only when that subcommand runs: `pdserve --help` loads no torch, and a subcommand whose
module cannot be imported (a missing package or dependency) fails alone, with one line
naming what is missing, while the others keep working.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    module: str = ""                         # has add_arguments(parser) and run(args)
    subcommands: tuple[Command, ...] = ()    # a group of commands instead (`pdserve bench serve`)


COMMANDS = (
    Command("generate", "generate text from one prompt with the offline engine", "pdserve.cli.generate"),
    Command("up", "start kvstore, prefill and decode workers and the router locally", "pdserve.cli.up"),
    Command("kvstore", "run the KV cache service", "pdserve.services.kvstore.main"),
    Command("prefill", "run a prefill worker", "pdserve.services.prefill.main"),
    Command("decode", "run a decode worker", "pdserve.services.decode.main"),
    Command("router", "run the router", "pdserve.services.router.main"),
    Command("bench", "benchmarks", subcommands=(
        Command("serve", "benchmark a serving endpoint (router gRPC or OpenAI HTTP)", "pdserve.cli.bench.main"),)),
    Command("profile", "measure step and KV transfer costs for the simulator", "pdserve.profiler.measure"),
    Command("sim", "simulate a cluster on a Mooncake trace", "pdserve.sim.main"),
    Command("plan", "recommend prefill:decode pool sizes from simulations", "pdserve.sim.plan"),
)


class CommandUnavailable(Exception):
    """A subcommand's module failed to import; the message names the command and what is missing."""


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv`: only the subcommand argv names gets its arguments (and imports
    its module). With argv None every subcommand is loaded: the whole command line, for
    tests that parse rendered manifests."""
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    _add_commands(parser, COMMANDS, None if argv is None else list(argv), ("pdserve",), "command")
    return parser


def _add_commands(parser, commands, words: list[str] | None, path: tuple[str, ...], dest: str) -> None:
    sub = parser.add_subparsers(dest=dest, required=True)
    chosen = None if words is None else _first_word(words)
    for command in commands:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        if words is not None and command.name != chosen:
            continue
        if command.subcommands:
            rest = None if words is None else words[words.index(chosen) + 1:]
            _add_commands(p, command.subcommands, rest, path + (command.name,), f"{command.name}_command")
        else:
            _load(command, p, " ".join(path + (command.name,)))


def _first_word(words: list[str]) -> str | None:
    """The subcommand argv names: its first word that is not an option (this level has only -h)."""
    return next((w for w in words if not w.startswith("-")), None)


def _load(command: Command, parser: argparse.ArgumentParser, full_name: str) -> None:
    try:
        module = importlib.import_module(command.module)
    except ImportError as e:
        missing = f"module '{e.name}'" if e.name else "a module"
        raise CommandUnavailable(f"'{full_name}' is unavailable: {missing} could not be imported "
                                 f"while loading {command.module} ({e})") from None
    module.add_arguments(parser)
    parser.set_defaults(func=module.run)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser(argv).parse_args(argv)
    except CommandUnavailable as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    from pdserve.engine.errors import InvalidRequestError, ModelLoadError
    try:
        return args.func(args)
    except (InvalidRequestError, ModelLoadError, ValueError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
