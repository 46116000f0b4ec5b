"""What this API does with each body field vLLM's OpenAI server knows (docs/openai.md,
"Every field"): honoured (translate.py), refused, or ignored because it changes no output.

    refused  a 400 naming the field when it is set to anything but a neutral value: a field
             that would change the output is never dropped silently
    ignored  accepted, changes nothing; logged once per field name, as vLLM logs "The
             following fields were present in the request but ignored"
    unknown  a field no table row names: it passes (clients send many), logged the same way

schemas.py types every field (a bad type is a 400 too); the table in docs/openai.md is
the contract, and tests/services/router/fronts/http/test_field_table.py walks it against
a running server.
"""
from __future__ import annotations

import logging
import threading

from pydantic import BaseModel

from pdserve.services.router.fronts.http.errors import bad_request

logger = logging.getLogger(__name__)

# field -> its neutral values (the defaults: what a client that does not mean the feature sends)
_REFUSED_BOTH = {
    "use_beam_search": (None, False),
    "spaces_between_special_tokens": (None, True),
    "priority": (None, 0),
    "logits_processors": (None, []),
    "kv_transfer_params": (None, {}),
    "vllm_xargs": (None, {}),
}
REFUSED = {
    "completions": dict(_REFUSED_BOTH, suffix=(None, ""), prompt_embeds=(None, []),
                        add_special_tokens=(None, True)),
    # a request's own chat_template is refused as vLLM refuses it without --trust-request-chat-template
    "chat": dict(_REFUSED_BOTH, add_special_tokens=(None, False), chat_template=(None,)),
}  # also refused, by the code that reads them: best_of other than n (translate.py), functions (structured.py)
# refused in stream_options, unless neutral (continuous_usage_stats is honoured: replies.py)
REFUSED_STREAM_OPTIONS: dict[str, tuple] = {}
IGNORED = frozenset({"user", "length_penalty", "mm_processor_kwargs", "service_tier", "store", "metadata"})


def refuse_unsupported(body: BaseModel, api: str) -> None:
    """A 400 naming the first refused field set to a non-neutral value."""
    for name, neutral in REFUSED[api].items():
        value = getattr(body, name, None)
        if not _is_neutral(value, neutral):
            raise bad_request(name, f"is not supported (only {_shown(neutral)})")
    options = getattr(body, "stream_options", None)
    for name, neutral in REFUSED_STREAM_OPTIONS.items():
        if options is not None and not _is_neutral(getattr(options, name, None), neutral):
            raise bad_request(f"stream_options.{name}", f"is not supported (only {_shown(neutral)})")


def _is_neutral(value, neutral: tuple) -> bool:
    # by type as well: JSON's 0 is not false, nor 1.0 true
    return any(value == n and type(value) is type(n) for n in neutral)


def _shown(neutral: tuple) -> str:
    return " or ".join("unset" if n is None else repr(n).replace("True", "true").replace("False", "false")
                       for n in neutral)


class IgnoredFields:
    """Logs each ignored or unknown field name the first time a request sends it; one
    instance per app (its memory: at most the distinct names clients sent, capped)."""
    MAX_NAMES = 1024  # past this many distinct names, new ones are no longer logged

    def __init__(self):
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def noted(self, body: BaseModel, job):
        """`job` (the body's translation, which refused nothing), once `body` is noted."""
        self.note(body)
        return job

    def note(self, body: BaseModel) -> None:
        names = set(body.model_extra or ()) | (IGNORED & body.model_fields_set)
        options = getattr(body, "stream_options", None)
        if options is not None:
            names |= {f"stream_options.{k}" for k in options.model_extra or ()}
        with self._lock:
            new = sorted(n for n in names if n not in self._logged)[:self.MAX_NAMES - len(self._logged)]
            self._logged.update(new)
        for name in new:
            logger.warning("The following field was present in the request but ignored: %r (logged once "
                           "per field name)", name[:64])
