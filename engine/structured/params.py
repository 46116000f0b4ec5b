"""What a request's output must match: exactly one of a JSON schema, any JSON object, a
regular expression, a list of choices or an EBNF grammar (vLLM's StructuredOutputsParams
names, so users' code ports)."""
from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass

from pdserve.engine.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Bounds on a spec's size: compiling is superlinear in it, and a spec travels with every
# hop of a request (router, prefill, decode, a migration).
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024
# Objects and arrays nested deeper than this in a JSON schema are refused: real schemas nest a
# few levels, and each level costs the grammar compiler (800 levels held a worker for 30 s)
MAX_SCHEMA_DEPTH = 64
# How long a spec may take to compile before its request is refused. A compile cannot be
# interrupted (xgrammar runs it in C++), so past this the request fails and the thread
# finishes on its own; the result is still cached for the next request with that spec.
# Here, not in grammar.py: the router and the engine config read it without loading torch.
DEFAULT_COMPILE_TIMEOUT_S = 30.0


def nesting_depth(value) -> int:
    """How deeply objects and arrays nest in a parsed JSON value (a scalar: 0), counted
    without recursion: a schema nested 100,000 deep must not take the stack down."""
    depth, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        depth = max(depth, level)
        stack.extend((child, level + 1) for child in children)
    return depth


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | bool | None = None  # a JSON schema: a dict, or its JSON text
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None  # EBNF, as xgrammar (and llama.cpp's GBNF) reads it
    json_object: bool = False   # any JSON object
    # JSON only: no whitespace between tokens (a small model may otherwise pad forever)
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if self._is_set(k))

    def _is_set(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value is True if kind == "json_object" else value is not None

    def validate(self) -> None:
        """Exactly one spec, of the right type and size; raises InvalidRequestError naming
        `structured_outputs.<kind>`. Whether the spec compiles is grammar.py's check."""
        given = [k for k in KINDS if self._is_set(k)]
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs", "exactly one of json, regex, choice, grammar or "
                                                            f"json_object must be set, got {given or 'none'}")
        kind = given[0]
        field = f"structured_outputs.{kind}"
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    parsed = jsonlib.loads(self.json)
                except ValueError as e:
                    raise InvalidRequestError(field, f"is not valid JSON: {e}") from None
                except RecursionError:
                    raise InvalidRequestError(field, "is nested too deeply") from None
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                raise InvalidRequestError(field, f"must be a JSON schema (an object), got {type(parsed).__name__}")
            if (depth := nesting_depth(parsed)) > MAX_SCHEMA_DEPTH:
                raise InvalidRequestError(field, f"is nested {depth} levels deep; at most {MAX_SCHEMA_DEPTH}")
        elif kind == "choice":
            if not self.choice:
                raise InvalidRequestError(field, "must hold at least one choice")
            if len(self.choice) > MAX_CHOICES:
                raise InvalidRequestError(field, f"at most {MAX_CHOICES} choices, got {len(self.choice)}")
            if any(not isinstance(c, str) or not c for c in self.choice):
                raise InvalidRequestError(field, "every choice must be a non-empty string")
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise InvalidRequestError(field, "must be a non-empty string")
        if len(self.spec_text) > MAX_SPEC_CHARS:
            raise InvalidRequestError(field, f"is {len(self.spec_text)} characters; at most {MAX_SPEC_CHARS}")

    @property
    def spec_text(self) -> str:
        """The spec as one string: what the compiler caches by, with kind. A schema keeps
        its key order: xgrammar generates properties in that order."""
        kind = self.kind
        if kind == "json":
            return self.json if isinstance(self.json, str) else jsonlib.dumps(self.json)
        if kind == "choice":
            return jsonlib.dumps(list(self.choice))
        if kind == "json_object":
            return ""
        return getattr(self, kind)

    @property
    def key(self) -> tuple[str, str, bool]:
        return self.kind, self.spec_text, self.disable_any_whitespace
