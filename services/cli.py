"""The `pdserve` command line."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from one prompt with the offline engine")
    p.add_argument("--model", default="smollm2", help="HF folder, .gguf file or alias (default: smollm2)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--logprobs", type=int, default=None, help="top-N logprobs per token (with --json)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--attention-backend", default="torch", choices=["torch", "triton"])
    p.add_argument("--json", action="store_true", help="print the full output as JSON")
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    from engine import LLM, InvalidRequestError, SamplingParams
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                            logprobs=args.logprobs)
    if not args.prompt:
        raise InvalidRequestError("prompt", "is empty")
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, attention_backend=args.attention_backend)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from engine.errors import InvalidRequestError, ModelLoadError
    try:
        return args.func(args)
    except (InvalidRequestError, ModelLoadError, ValueError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
