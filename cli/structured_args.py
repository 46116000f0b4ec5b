"""`pdserve generate`'s structured-output flags: at most one of them, turned into the
engine's StructuredOutputsParams (which the offline engine and `--url`'s router both take).

    --json-schema FILE   a JSON schema        --regex R      a regular expression
    --choice A --choice B  one of the strings  --grammar FILE an EBNF grammar
    --json-object        any JSON object
"""
from __future__ import annotations

import argparse
import json

from pdserve.engine.structured import StructuredOutputsParams


def add_structured_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("structured outputs (guided decoding; at most one)")
    one = group.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="FILE", help="the output follows this JSON schema (a .json file)")
    one.add_argument("--regex", help="the output matches this regular expression")
    one.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these (repeatable)")
    one.add_argument("--grammar", metavar="FILE", help="the output follows this EBNF grammar (xgrammar's dialect)")
    one.add_argument("--json-object", action="store_true", help="the output is a JSON object")


def structured_from_args(args) -> StructuredOutputsParams | None:
    """Raises ValueError naming the flag (an unreadable file, a schema that is not JSON) or
    InvalidRequestError (the engine's own checks, naming structured_outputs.<kind>)."""
    if args.json_schema is not None:
        text = _read("--json-schema", args.json_schema)
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--json-schema: {args.json_schema} is not JSON ({e})") from None
        return StructuredOutputsParams(json=schema)
    if args.grammar is not None:
        return StructuredOutputsParams(grammar=_read("--grammar", args.grammar))
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    if args.choice is not None:
        return StructuredOutputsParams(choice=args.choice)
    if args.json_object:
        return StructuredOutputsParams(json_object=True)
    return None


def _read(flag: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}: cannot read {path} ({e})") from None
