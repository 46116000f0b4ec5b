"""The HTTP API under schemathesis: requests generated from its own /openapi.json, valid and
invalid, against a real router in front of the real workers: no 5xx, ever. Bounded: a few
examples per operation and mode, a router with a 64-token context and at most 4 choices a
request, derandomized (the same examples every run).

Each operation's strategy is driven by hypothesis directly: schemathesis' pytest plugin
does not load under this pytest."""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from pdserve.services.router.fronts.http import fields
from pdserve.services.router.fronts.http.config import HttpConfig
from tests.services.router.fronts.http.support import start_router

MAX_EXAMPLES = 12  # per operation and mode
OPERATIONS = {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
              "GET /v1/models/{model}", "GET /health", "GET /metrics",
              "POST /tokenize", "POST /detokenize", "GET /version"}


@pytest.fixture(scope="module")
def fuzz_router(shared_cluster, tiny, tiny_llama_dir):
    router = start_router(shared_cluster, tiny_llama_dir, tiny.tokenizer,
                          http=HttpConfig(port=0, max_choices=4), max_model_len=64)
    yield router
    router.stop(grace_s=0)


# refused by design unless neutral (translate.py), or unknown to this router (slo_class):
# left out, so valid bodies get further
REFUSED = ("tools", "functions", "response_format", "echo", "suffix", "best_of", "stream_options", "slo_class",
           *fields.REFUSED["chat"], *fields.REFUSED["completions"])
# numbers folded into their valid ranges: the random texts (prompts, messages, stop strings)
# are what reaches the tokenizer and the workers
FOLD = {"max_tokens": lambda v: 1 + abs(v) % 8, "max_completion_tokens": lambda v: 1 + abs(v) % 8,
        "n": lambda v: 1 + abs(v) % 2, "temperature": lambda v: abs(v) % 2, "top_p": lambda v: 0.5 + abs(v) % 0.5,
        "min_p": lambda v: abs(v) % 1, "top_k": lambda v: abs(v) % 50, "seed": lambda v: abs(v) % 1000,
        "logprobs": lambda v: v if isinstance(v, bool) else abs(v) % 3, "top_logprobs": lambda v: abs(v) % 3,
        "stop_token_ids": lambda v: [abs(t) % 49152 for t in v],
        "presence_penalty": lambda v: abs(v) % 2, "frequency_penalty": lambda v: -(abs(v) % 2),
        "repetition_penalty": lambda v: 0.5 + abs(v) % 1, "min_tokens": lambda v: abs(v) % 2,
        "allowed_token_ids": lambda v: [abs(t) % 49152 for t in v] or None,
        "logit_bias": lambda v: {str(sum(map(ord, k)) % 49152): abs(b) % 100 for k, b in v.items()}}


def _servable(name: str):
    """Valid bodies name the served model and drop what is refused by design, so most of
    them reach the routing flow and the workers."""
    def fix(case):
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = name
            for key in REFUSED:
                case.body.pop(key, None)
            for key, fold in FOLD.items():
                if case.body.get(key) is not None:
                    case.body[key] = fold(case.body[key])
            if case.body.get("top_logprobs") is not None:
                case.body["logprobs"] = True
        return case
    return fix


def _no_server_error(case) -> None:
    response = case.call(timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path}: {response.status_code} {response.text[:500]}"
    if response.status_code >= 400:
        assert "127.0.0.1" not in response.text  # no error names a worker


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_request_is_a_server_error(fuzz_router, cluster, mode):
    # `cluster`: afterwards every block is free and no lease is left behind
    schema = schemathesis.openapi.from_url(f"http://127.0.0.1:{fuzz_router.http_port}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} == OPERATIONS
    for operation in operations:
        if mode == GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # nothing to make invalid: no body, and a path parameter is any string
        strategy = operation.as_strategy(generation_mode=mode)
        if mode == GenerationMode.POSITIVE:
            strategy = strategy.map(_servable(fuzz_router.servicer.model.name))
        run = given(case=strategy)(_no_server_error)
        settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))(run)()
