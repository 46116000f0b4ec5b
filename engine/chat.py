"""A conversation as a prompt: the model's chat template, applied the same way by the
offline `LLM.chat`, `pdserve generate --chat` and the router's /v1/chat/completions, so the
three send a model the same tokens for the same messages.

What a user writes stays text. A message whose content spells a control token (say
"<|im_start|>system") would, tokenized with the rendered prompt, become that token and open
a turn the user may not open. Such a content is tokenized on its own with special tokens
split (as OpenAI treats them: plain text); the template's own parts keep theirs:

    rendered with markers:  <|im_start|>user\\n  [content 0]  <|im_end|>\\n<|im_start|>assistant\\n
                            └ template: specials ┘ └ plain ┘  └ template: specials ──────────────┘

Plain text rather than a refusal: a user may quote such text (a question about chat
templates, a pasted log) and deserves an answer. Contents without control-token text take
the usual path (the rendered prompt tokenized whole), so their tokens are unchanged. A
refusal is left only for a template that rewrites contents (trims them, say), where the
split cannot be proven exact, and for tool definitions and earlier tool calls spelling a
control token: the template writes those itself (tojson), with no place for a marker.
"""
from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass, field

from pdserve.engine.errors import InvalidRequestError

ROLES = ("system", "user", "assistant", "tool")
# apply_chat_template's own parameters, and what it is given here: no template variable may
# take their place (vLLM refuses chat_template and tokenize the same way)
RESERVED_VARIABLES = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
                                "padding", "truncation", "max_length", "return_assistant_tokens_mask",
                                "tokenizer_kwargs"})


@dataclass(frozen=True)
class TemplateOptions:
    """The template's inputs besides the messages and tools, as vLLM's chat requests set them:
    `add_generation_prompt` opens the assistant's turn; `continue_final_message` leaves the
    last message open instead, for the model to go on with it (the two exclude each other);
    `documents` go to templates that render them (RAG); `variables` are vLLM's
    chat_template_kwargs (enable_thinking, reasoning_effort ...), each a variable of the
    template, which one that does not read it ignores."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict] | None = None
    variables: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequestError("continue_final_message", "cannot be true with add_generation_prompt true "
                                                                "(set add_generation_prompt: false)")
        for name in self.variables:
            if name in RESERVED_VARIABLES:
                raise InvalidRequestError(f"chat_template_kwargs.{name}", "is set by the request itself, "
                                                                          "not a template variable")

    def kwargs(self) -> dict:
        """apply_chat_template's keyword arguments (those left at transformers' defaults unsaid)."""
        extra = {"documents": self.documents} if self.documents else {}
        if self.continue_final_message:
            extra["continue_final_message"] = True
        return dict(self.variables, add_generation_prompt=self.add_generation_prompt, **extra)


DEFAULT_OPTIONS = TemplateOptions()
_JINJA_CHARS = "{}\n"  # a value with none of them is meant as a file name


def load_chat_template(value: str) -> str:
    """vLLM's --chat-template: the contents of the file `value` names, or `value` itself when
    it is no file but looks like a template. Raises ValueError naming chat_template when the
    file cannot be read or the template does not parse as Jinja (checked at start, not at the
    first chat request)."""
    try:
        with open(value, encoding="utf-8") as f:
            template = f.read()
    except (OSError, UnicodeDecodeError) as e:
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(f"chat_template: cannot read the file {value!r} ({e})") from None
        template = value
    _check_jinja(template)
    return template


def with_chat_template(tokenizer, template: str | None):
    """`tokenizer` rendering chats with `template` (None: its own): a shallow copy, so that
    the original, which other engines or routers in this process may share, keeps its own."""
    if template is None:
        return tokenizer
    renamed = copy.copy(tokenizer)
    renamed.chat_template = template
    return renamed


def _check_jinja(template: str) -> None:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTags(jinja2.ext.Extension):
        """transformers' {% generation %}...{% endgeneration %} (marks the assistant's text): its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            return jinja2.nodes.Scope(parser.parse_statements(("name:endgeneration",), drop_needle=True),
                                      lineno=lineno)

    env = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols, GenerationTags])
    try:
        env.parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: not a Jinja template: {e.message} (line {e.lineno})") from None


def render_chat_prompt(tokenizer, conversation: list[dict], tools: list[dict] | None = None,
                       options: TemplateOptions = DEFAULT_OPTIONS) -> str:
    """The prompt text for `conversation` ([{"role", "content"}, ...]) with the assistant's turn
    opened (unless `options` say otherwise); `tools` (OpenAI's [{"type": "function", "function": {...}}]) go to the template as
    transformers passes them, for the templates that render them. An assistant message may
    carry OpenAI's `tool_calls`, whose JSON-text arguments the template gets as objects (what
    HF templates expect: `tool_call.arguments | tojson`), and a tool message its `tool_call_id`.
    Raises InvalidRequestError("messages", ...) when the model has no template, a message is
    malformed, or the template itself refuses the conversation."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("messages", "this model has no chat template")
    if not all(isinstance(m, dict) and "role" in m and "content" in m for m in conversation):
        raise InvalidRequestError("messages", "each message needs 'role' and 'content'")
    for i, message in enumerate(conversation):
        _check_message(i, message)
    messages = [_with_call_objects(i, m) for i, m in enumerate(conversation)]
    extra = {"tools": tools} if tools else {}
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **extra, **options.kwargs())
    except Exception as e:  # the template's own checks (e.g. role order) raise from Jinja
        raise InvalidRequestError("messages", f"the chat template refused them: {e}") from None


def encode_chat_prompt(tokenizer, conversation: list[dict], tools: list[dict] | None = None,
                       options: TemplateOptions = DEFAULT_OPTIONS) -> tuple[str, list[int]]:
    """The rendered prompt and its token ids. No special tokens are added: the template
    already wrote them (a second BOS would change the model's answer). Tool definitions and
    earlier tool calls are rendered by the template itself (tojson), where no marker can
    keep them apart from its own text: one that spells a control token is refused."""
    text = render_chat_prompt(tokenizer, conversation, tools, options)
    specials = _special_tokens(tokenizer)
    _refuse_control_text_outside_contents(specials, conversation, tools, options)
    spelled = [_control_text(specials, m["content"]) for m in conversation]
    if not any(spelled):
        return text, list(tokenizer.encode(text, add_special_tokens=False))
    return text, _encode_contents_plain(tokenizer, conversation, text, spelled, tools, options)


def _with_call_objects(index: int, message: dict) -> dict:
    """The message with its tool calls' arguments as objects (a copy; vLLM does the same)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              for c in calls):
        raise InvalidRequestError(f"messages[{index}].tool_calls", "each must be {\"type\": \"function\", "
                                                                   "\"function\": {\"name\", \"arguments\"}}")
    return dict(message, tool_calls=[_call_object(index, j, c) for j, c in enumerate(calls)])


def _call_object(index: int, j: int, call: dict) -> dict:
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str) and arguments.strip():
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            raise InvalidRequestError(f"messages[{index}].tool_calls[{j}].function.arguments",
                                      "is not JSON text") from None
    elif not arguments:
        arguments = {}
    return dict(call, function=dict(call["function"], arguments=arguments))


def _refuse_control_text_outside_contents(specials: list[str], conversation: list[dict], tools: list[dict] | None,
                                          options: TemplateOptions = DEFAULT_OPTIONS) -> None:
    fields = [("tools", tools)] if tools else []
    fields += [("documents", options.documents)] if options.documents else []
    fields += [(f"chat_template_kwargs.{k}", v) for k, v in options.variables.items()]
    for i, message in enumerate(conversation):
        fields += [(f"messages[{i}].{k}", v) for k, v in message.items() if k not in ("role", "content")]
    for name, value in fields:
        token = _control_text(specials, json.dumps(value, ensure_ascii=False, default=str))
        if token:
            raise InvalidRequestError(name, f"spells the control token {token!r}, which the chat template would "
                                            "write into the prompt as that token: remove it")


def _check_message(index: int, message: dict) -> None:
    if message["role"] not in ROLES:
        role = str(message["role"])[:40]
        raise InvalidRequestError(f"messages[{index}].role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    content = message["content"]
    if isinstance(content, str):
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:  # JSON's "\ud800": half a UTF-16 pair, not text
            raise InvalidRequestError(f"messages[{index}].content", "holds a lone UTF-16 surrogate") from None


def _control_text(specials: list[str], content) -> str | None:
    """The first special token whose text `content` spells, if any."""
    if not isinstance(content, str):
        return None
    return next((t for t in specials if t in content), None)


def _special_tokens(tokenizer) -> list[str]:
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    tokens = {t.content for t in added.values() if getattr(t, "special", False)}
    return sorted(tokens | set(getattr(tokenizer, "all_special_tokens", ()) or ()))


def _encode_contents_plain(tokenizer, conversation: list[dict], text: str, spelled: list[str | None],
                           tools: list[dict] | None = None, options: TemplateOptions = DEFAULT_OPTIONS) -> list[int]:
    """Render with a unique marker in place of each content; the pieces between markers are
    the template's own. Exact only if those pieces and the contents rebuild `text`."""
    nonce = uuid.uuid4().hex
    markers = [f"\x00{nonce}:{i}\x00" for i in range(len(conversation))]
    marked = [dict(m, content=markers[i]) if isinstance(m["content"], str) else m for i, m in enumerate(conversation)]
    pieces = _split_at_markers(render_chat_prompt(tokenizer, marked, tools, options), markers)
    if pieces is None or "".join(p if i is None else conversation[i]["content"] for p, i in pieces) != text:
        index = next(i for i, token in enumerate(spelled) if token)
        raise InvalidRequestError(f"messages[{index}].content", f"spells the control token {spelled[index]!r}, "
                                  f"which this model's chat template cannot keep apart from its own: remove it")
    ids: list[int] = []
    for piece, index in pieces:
        if index is None:
            ids += tokenizer.encode(piece, add_special_tokens=False)
        else:
            ids += tokenizer.encode(conversation[index]["content"], add_special_tokens=False,
                                    split_special_tokens=True)
    return ids


def _split_at_markers(rendered: str, markers: list[str]) -> list[tuple[str, int | None]] | None:
    """[(template text, None) | ("", message index)] in order; None if a marker is missing
    or repeated (the template dropped or copied a content)."""
    pieces: list[tuple[str, int | None]] = []
    rest = rendered
    while True:
        hits = [(rest.find(m), i) for i, m in enumerate(markers) if m in rest]
        if not hits:
            break
        at, index = min(hits)
        pieces += [(rest[:at], None), ("", index)]
        rest = rest[at + len(markers[index]):]
    pieces.append((rest, None))
    found = [i for _, i in pieces if i is not None]
    if len(found) != len(set(found)):
        return None
    return [(p, i) for p, i in pieces if p or i is not None]
