"""`pdserve generate --url`: the offline command's output, streamed through a router."""
from __future__ import annotations

import json
import os
import sys

import grpc

from pdserve.services.common.tls import ClientTLS
from pdserve.services.router.client import RouterClient
from pdserve.services.router.fronts.http.config import API_KEY_ENV


def generate_remote(args, params) -> int:
    # the API key and a TLS router's CA from the environment, as the chart's `helm test` pod sets them
    ca_file = os.environ.get("PDSERVE_TLS_CA_FILE")
    client = RouterClient(args.url, api_key=os.environ.get(API_KEY_ENV) or None,
                          tls=ClientTLS(ca_file) if ca_file else None)
    prompt = args.prompt
    if args.chat:
        from pdserve.engine import load_tokenizer
        from pdserve.engine.chat import encode_chat_prompt, load_chat_template, with_chat_template
        template = load_chat_template(args.chat_template) if args.chat_template is not None else None
        tokenizer = with_chat_template(load_tokenizer(args.model, args.revision), template)
        _, prompt = encode_chat_prompt(tokenizer, [{"role": "user", "content": args.prompt}])
    text, token_ids, record = [], [], {}
    try:
        for msg in client.generate(prompt, params, slo_class=args.slo_class):
            text.append(msg.text)
            token_ids.extend(msg.token_ids)
            if not args.json:
                print(msg.text, end="", flush=True)
            if msg.finish_reason:
                record = {"req_id": msg.req_id, "finish_reason": msg.finish_reason,
                          "usage": {"prompt_tokens": msg.usage.prompt_tokens,
                                    "completion_tokens": msg.usage.completion_tokens,
                                    "cached_prompt_tokens": msg.usage.cached_prompt_tokens}}
    except grpc.RpcError as e:
        print(f"pdserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    finally:
        client.close()
    if args.json:
        print(json.dumps({"text": "".join(text), "token_ids": token_ids, **record}, ensure_ascii=False, indent=2))
    else:
        print()
    return 0
