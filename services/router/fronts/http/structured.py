"""Guided decoding from an OpenAI body: every way to ask for it becomes the engine's one
`StructuredOutputsParams`, which then travels with each of the request's choices.

    response_format {"type": "json_object"}                         json_object
    response_format {"type": "json_schema", "json_schema": {schema}}  json = schema
    structured_outputs {json | regex | choice | grammar | json_object}  (vLLM's extra body) the same
    tools + tool_choice {"type": "function", "function": {"name"}}  json = that function's parameters
    tools + tool_choice "required"                                  json = one call {"name", "arguments"}
                                                                    of any tool (a list of them unless
                                                                    parallel_tool_calls is false)
    tools + tool_choice "none" or "auto"                            no grammar (the tools are still
                                                                    rendered into the prompt)

At most one of response_format, structured_outputs and a forcing tool_choice: two are
refused naming the second. structured_outputs.disable_any_whitespace alone is an option for
whichever JSON spec is given (JSON with no whitespace between tokens: a small model may
otherwise pad forever); tool calls default to it, their arguments being read by programs.

tool_choice "auto" (also the default when tools are given) is no grammar: the model writes
calls in its own format, or text, and the tool-call parser tells them apart
(output_parsers.py); "required" and a named function need no parser, since the grammar
makes the whole output the call. The reply turns it into `tool_calls` (tool_calls.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdserve.engine import InvalidRequestError
from pdserve.engine.structured import StructuredOutputsParams
from pdserve.services.router.fronts.http.errors import bad_request, from_invalid
from pdserve.services.router.fronts.http.schemas import ChatCompletionRequest, _GenerateRequest

# a function without parameters takes none (OpenAI's reading): its arguments are {}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# vLLM's names before structured_outputs; silently ignoring them would return unconstrained text
_OLD_NAMES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
              "guided_grammar": "grammar", "guided_json_object": "json_object"}


@dataclass(frozen=True)
class ToolChoice:
    """The output is tool calls: to the function `name`, or (None: "required") to any of the
    tools, the model writing {"name": ..., "arguments": ...} for each."""
    name: str | None
    parallel: bool = False  # "required": a list of calls rather than one


@dataclass(frozen=True)
class Guide:
    params: StructuredOutputsParams | None = None
    tool_choice: ToolChoice | None = None
    source: str = ""  # the client's field that asked for it
    # the engine's field names (structured_outputs.<kind>) -> the client's, for errors
    rename: dict[str, str] = field(default_factory=dict)


def guide(body: _GenerateRequest) -> Guide:
    """Raises ApiError (400) naming the client's field."""
    _refuse_old_names(body)
    candidates = [g for g in (_from_tools(body), _from_response_format(body), _from_structured_outputs(body))
                  if g is not None]
    if len(candidates) > 1:
        first, second = (g.source for g in candidates[:2])
        raise bad_request(second, f"cannot be combined with {first}: give one way to constrain the output")
    return _with_whitespace_option(body, candidates[0] if candidates else Guide())


def _with_whitespace_option(body: _GenerateRequest, g: Guide) -> Guide:
    option = body.structured_outputs.disable_any_whitespace if body.structured_outputs is not None else None
    if option is None:
        option = g.tool_choice is not None
    elif option and (g.params is None or g.params.kind not in ("json", "json_object")):
        raise bad_request("structured_outputs.disable_any_whitespace", "applies to a JSON output only (a json "
                                                                       "schema, json_object, response_format or tools)")
    if not option:
        return g
    return replace(g, params=replace(g.params, disable_any_whitespace=True))


def _refuse_old_names(body: _GenerateRequest) -> None:
    for name, kind in _OLD_NAMES.items():
        if (body.model_extra or {}).get(name) is not None:
            raise bad_request(name, f"is vLLM's old name and is not read here; use structured_outputs.{kind}")


def _params(rename: dict[str, str], **spec) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**spec)
    except InvalidRequestError as e:
        raise from_invalid(e, rename) from None


def _from_response_format(body: _GenerateRequest) -> Guide | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    rename = {"structured_outputs": "response_format", "structured_outputs.json_object": "response_format"}
    if fmt.type == "json_object":
        return Guide(_params(rename, json_object=True), source="response_format", rename=rename)
    if fmt.json_schema is None:
        raise bad_request("response_format.json_schema", 'is required with {"type": "json_schema"}')
    if fmt.json_schema.schema_ is None:
        raise bad_request("response_format.json_schema.schema", "is required: the JSON schema of the output")
    rename["structured_outputs.json"] = "response_format.json_schema.schema"
    return Guide(_params(rename, json=fmt.json_schema.schema_), source="response_format", rename=rename)


def _from_structured_outputs(body: _GenerateRequest) -> Guide | None:
    so = body.structured_outputs
    if so is None or (so.disable_any_whitespace is not None and not _spec_given(so)):
        return None  # none, or only the option (for another spec)
    rename = {"structured_outputs": "structured_outputs"}
    return Guide(_params(rename, json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                         json_object=bool(so.json_object)), source="structured_outputs", rename=rename)


def _spec_given(so) -> bool:
    return any(v is not None for v in (so.json_, so.regex, so.choice, so.grammar, so.json_object))


def _from_tools(body: _GenerateRequest) -> Guide | None:
    if not isinstance(body, ChatCompletionRequest):
        return None
    if body.functions:
        raise bad_request("functions", "is not supported; use tools with tool_choice")
    choice, tools = body.tool_choice, body.tools or []
    if choice in (None, "none", "auto"):  # "auto" (the default): output_parsers.py
        return None
    if not tools:
        raise bad_request("tools", "must hold at least one tool when tool_choice forces a call")
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad_request(f"tools[{i}].function.name", f"{name!r} is given twice")
    if choice == "required":
        return _required(body, tools)
    if choice.function.name not in names:
        raise bad_request("tool_choice.function.name", f"{choice.function.name!r} is not among the tools {names}")
    i = names.index(choice.function.name)
    rename = {"structured_outputs": "tool_choice", "structured_outputs.json": f"tools[{i}].function.parameters"}
    return Guide(_params(rename, json=_parameters(tools[i])), ToolChoice(names[i]), "tool_choice", rename)


def _required(body: ChatCompletionRequest, tools) -> Guide:
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    one_call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    parallel = body.parallel_tool_calls is not False  # OpenAI's default: true
    schema = {"type": "array", "items": one_call, "minItems": 1} if parallel else one_call
    rename = {"structured_outputs": "tool_choice", "structured_outputs.json": "tools"}
    return Guide(_params(rename, json=schema), ToolChoice(None, parallel), "tool_choice", rename)


def _parameters(tool) -> dict:
    return tool.function.parameters if tool.function.parameters is not None else NO_PARAMETERS
