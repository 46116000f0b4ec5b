"""Where requests go: the router over gRPC (with the services' own TTFT timings) or any
OpenAI-compatible server's streaming /v1/completions. A target sends one request and
returns what the client saw: when each streamed chunk arrived and how many tokens it had,
the usage, the finish reason and, over gRPC, the timings of the final message."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.cli.bench.datasets import BenchRequest
from pdserve.services.common.defaults import HOST, ROUTER_ADDRESS, ROUTER_HTTP_PORT

BACKENDS = ("grpc", "openai")
# each backend's default: the router `pdserve up` starts
DEFAULT_URLS = {"grpc": ROUTER_ADDRESS, "openai": f"http://{HOST}:{ROUTER_HTTP_PORT}/v1"}
TIMING_FIELDS = ("router_queue_s", "prefill_queue_s", "prefill_s", "kv_write_s", "kv_read_s", "decode_join_s",
                 "ttft_s")


@dataclass(frozen=True)
class TargetConfig:
    backend: str = "grpc"
    url: str = DEFAULT_URLS["grpc"]  # grpc: host:port; openai: base URL (http://host:port/v1)
    model: str = ""               # openai: the model name (default: the first of /v1/models)
    api_key: str = "unused"      # the router's API key (gRPC and openai); "unused": none
    slo_class: str = ""           # sent as the request's SLO class when set
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float = 600.0      # per request

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"target: {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.timeout_s <= 0:
            raise ValueError("target: the request timeout must be positive")


@dataclass
class Outcome:
    """One request as the client saw it; times are time.perf_counter() values."""
    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) of chunks with tokens
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""
    timings: dict | None = None
    path: str = ""  # the router's choice (gRPC target only)
    error: str = ""


class GrpcTarget:
    """The router's Generate stream; prompts as token ids (text for text datasets)."""

    def __init__(self, cfg: TargetConfig):
        from pdserve.services.router.client import RouterClient
        self.cfg = cfg
        # "unused" is the OpenAI client's placeholder: a router without a key takes no header
        self.client = RouterClient(cfg.url, api_key=None if cfg.api_key == "unused" else cfg.api_key)

    def describe(self) -> dict:
        models = self.client.list_models(timeout_s=30)
        m = models[0]
        return {"model": m.id, "max_model_len": m.max_model_len, "vocab_size": m.vocab_size}

    def send(self, req: BenchRequest) -> Outcome:
        import grpc

        from pdserve.engine import SamplingParams
        params = SamplingParams(max_tokens=req.output_len, temperature=self.cfg.temperature,
                                ignore_eos=self.cfg.ignore_eos)
        prompt = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
        out = Outcome(sent=time.perf_counter())
        try:
            stream = self.client.generate(prompt, params, slo_class=self.cfg.slo_class or "interactive",
                                          timeout_s=self.cfg.timeout_s)
            for msg in stream:
                now = time.perf_counter()
                if msg.token_ids:
                    out.chunks.append((now, len(msg.token_ids)))
                if msg.finish_reason:
                    out.finish_reason = msg.finish_reason
                    out.prompt_tokens = msg.usage.prompt_tokens
                    out.output_tokens = msg.usage.completion_tokens
                    out.cached_tokens = msg.usage.cached_prompt_tokens
                    out.timings = {f: getattr(msg.timings, f) for f in TIMING_FIELDS}
                    out.path = msg.path
        except grpc.RpcError as e:
            out.error = f"{e.code().name}: {e.details()}"
        return out

    def close(self) -> None:
        self.client.close()


class OpenAITarget:
    """Streaming /v1/completions with usage; prompts as token ids (text for text datasets).
    Each chunk counts its logprobs' tokens when it has them, else one token; the totals
    come from the usage chunk."""

    def __init__(self, cfg: TargetConfig):
        import openai
        self.cfg = cfg
        self.client = openai.OpenAI(base_url=cfg.url, api_key=cfg.api_key, max_retries=0, timeout=cfg.timeout_s)
        self.model = cfg.model

    def describe(self) -> dict:
        models = self.client.models.list().data
        if not self.model:
            if not models:
                raise ValueError(f"{self.cfg.url}: /v1/models lists no model; give --model")
            self.model = models[0].id
        info = next((m for m in models if m.id == self.model), None)
        return {"model": self.model, "max_model_len": getattr(info, "max_model_len", None) if info else None,
                "vocab_size": None}

    def send(self, req: BenchRequest) -> Outcome:
        import openai
        extra = {"ignore_eos": True} if self.cfg.ignore_eos else {}
        if self.cfg.slo_class:
            extra["slo_class"] = self.cfg.slo_class
        prompt = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
        out = Outcome(sent=time.perf_counter())
        try:
            stream = self.client.completions.create(
                model=self.model, prompt=prompt, max_tokens=req.output_len, temperature=self.cfg.temperature,
                stream=True, stream_options={"include_usage": True}, extra_body=extra)
            bare_final = None  # the arrival of a final chunk without text: its token may be a partial character
            with stream:
                for chunk in stream:
                    now = time.perf_counter()
                    for choice in chunk.choices or []:
                        lp = choice.logprobs
                        if lp is not None and lp.tokens:
                            n = len(lp.tokens)
                        else:  # one chunk per router message: a token, even when its text is still empty
                            n = 1 if choice.text or not choice.finish_reason else 0
                        if n:
                            out.chunks.append((now, n))
                        if choice.finish_reason:
                            out.finish_reason = choice.finish_reason
                            bare_final = None if n else now
                    if chunk.usage is not None:
                        out.prompt_tokens = chunk.usage.prompt_tokens
                        out.output_tokens = chunk.usage.completion_tokens
                        details = getattr(chunk.usage, "prompt_tokens_details", None)
                        out.cached_tokens = (getattr(details, "cached_tokens", 0) or 0) if details else 0
            if bare_final is not None and sum(n for _, n in out.chunks) < out.output_tokens:
                out.chunks.append((bare_final, 1))
        except openai.APIError as e:
            out.error = f"{type(e).__name__}: {e}"
        return out

    def close(self) -> None:
        self.client.close()


def make_target(cfg: TargetConfig):
    return GrpcTarget(cfg) if cfg.backend == "grpc" else OpenAITarget(cfg)
