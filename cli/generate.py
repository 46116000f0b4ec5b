"""`pdserve generate`: one prompt through the offline engine, or through a running router (--url)."""
from __future__ import annotations

import dataclasses
import json

from pdserve.cli.structured_args import add_structured_arguments, structured_from_args
from pdserve.engine.config import DEFAULT_MODEL, EngineConfig
from pdserve.engine.dtypes import DTYPE_NAMES
from pdserve.services.router.config import DEFAULT_SLO_CLASS
from pdserve.services.worker.config import add_quantization_argument
from pdserve.services.worker.parallel_args import add_parallel_arguments, parallel_config_from_args


def add_arguments(p) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"HF folder, .gguf file, alias, or org/name from the local Hugging Face cache "
                        f"(default: {DEFAULT_MODEL})")
    p.add_argument("--revision", default=EngineConfig.revision,
                   help="with --model org/name: the branch, tag or commit in the cache (default: main)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="with --chat: a Jinja chat template file (or the template itself) in place of the "
                        "tokenizer's")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--logprobs", type=int, default=None, help="top-N logprobs per token (with --json)")
    p.add_argument("--dtype", default=EngineConfig.dtype, choices=DTYPE_NAMES)
    add_quantization_argument(p)
    p.add_argument("--device", default=EngineConfig.device)
    p.add_argument("--attention-backend", default=EngineConfig.attention_backend, choices=["cpu", "torch", "triton"])
    p.add_argument("--json", action="store_true", help="print the full output as JSON")
    p.add_argument("--url", default=None, help="a router's gRPC address (host:port): stream through the platform; "
                   "several, comma-separated (pdserve up --routers N): a stream cut by one's death goes on at the next")
    p.add_argument("--slo-class", default=DEFAULT_SLO_CLASS, help="with --url: the request's SLO class")
    add_structured_arguments(p)
    add_parallel_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from pdserve.engine import LLM, InvalidRequestError, SamplingParams
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                            logprobs=args.logprobs, structured_outputs=structured_from_args(args))
    if not args.prompt:
        raise InvalidRequestError("prompt", "is empty")
    if args.url:
        from pdserve.cli.remote_generate import generate_remote
        return generate_remote(args, params)
    parallel = parallel_config_from_args(args)
    llm = LLM(model=args.model, revision=args.revision, chat_template=args.chat_template, dtype=args.dtype,
              quantization=args.quantization,
              device=args.device, attention_backend=args.attention_backend,
              tensor_parallel_size=parallel.tensor_parallel_size,
              pipeline_parallel_size=parallel.pipeline_parallel_size,
              pipeline_layer_split=parallel.pipeline_layer_split, collective_timeout_s=parallel.collective_timeout_s)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    if args.json:
        record = dataclasses.asdict(out)
        for transient in ("new_token_ids", "new_text"):
            record.pop(transient)
        print(json.dumps(record, ensure_ascii=False, indent=2))
    else:
        print(out.text)
    return 0
