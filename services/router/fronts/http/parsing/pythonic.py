"""pythonic: Llama 3.2 / Llama 4 and ToolACE style, the output one Python list of calls with
keyword arguments:

    [get_weather(city="Paris", days=2), get_time()]

Read with `ast` (never evaluated): each argument must be a literal (strings, numbers, lists,
dicts, True/False/None; JSON's true/false/null too). All or nothing, as llama3_json: an
output that opens with "[" is held while streaming and is content unless it is wholly such
calls to known functions.
"""
from __future__ import annotations

import ast
from collections.abc import Collection

from pdserve.services.router.fronts.http.parsing.tool_parser import Segment, ToolCall, ToolParser, json_text, skip_space

_JSON_NAMES = {"true": True, "false": False, "null": None}


class PythonicParser(ToolParser):
    name = "pythonic"

    def split(self, text: str, start: int, names: Collection[str] | None,
              final: bool) -> tuple[list[Segment], int]:
        if start > 0:
            return [text[start:]], len(text)
        at = skip_space(text)
        if not final and (at == len(text) or text.startswith("[", at)):
            return [], 0  # a call may be coming: hold everything
        calls = _calls(text.strip(), names) if text.startswith("[", at) else None
        return (list(calls) if calls else [text]), len(text)


def _calls(source: str, names: Collection[str] | None) -> list[ToolCall] | None:
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = [_call(node, names) for node in tree.body.elts]
    return None if any(c is None for c in calls) else calls


def _call(node: ast.expr, names: Collection[str] | None) -> ToolCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    keys = [k.arg for k in node.keywords]
    if None in keys or len(set(keys)) < len(keys):  # **kwargs, or a keyword given twice
        return None
    if names is not None and node.func.id not in names:
        return None
    try:
        arguments = {k.arg: ast.literal_eval(_JsonNames().visit(k.value)) for k in node.keywords}
        return ToolCall(node.func.id, json_text(arguments))
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None  # not a literal, or not JSON (a set, bytes, inf)


class _JsonNames(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in _JSON_NAMES:
            return ast.copy_location(ast.Constant(_JSON_NAMES[node.id]), node)
        return node
