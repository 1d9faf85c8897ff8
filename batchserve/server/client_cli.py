"""`batchserve generate`: one request to a running server through `Client`, printed."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import grpc

from batchserve.server.client import FINISH_REASON_NAMES, Client
from batchserve.v1 import generation_pb2 as pb


def generate_command(args: Any) -> int:
    """`batchserve generate`: one request to a running server, printed as text or JSON."""
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    kwargs = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed}
    api_key = args.api_key or os.environ.get("BATCHSERVE_API_KEY") or None
    with Client(args.target, timeout=args.timeout, load_balancing=args.load_balancing, api_key=api_key) as client:
        try:
            if args.stream and not args.json:
                for chunk in client.stream(prompt, **kwargs):
                    print(chunk.text, end="", flush=True)
                print()
                return 0
            r = client.generate(prompt, **kwargs)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(_reply_json(r) if args.json else r.text)
    return 0


def _reply_json(r: pb.GenerateResponse) -> str:
    stats = {k: getattr(r.stats, k) for k in ("steps", "draft_tokens_proposed", "draft_tokens_accepted")}
    out = {
        "request_id": r.request_id,
        "text": r.text,
        "token_ids": list(r.token_ids),
        "finish_reason": FINISH_REASON_NAMES[r.finish_reason],
        "usage": {"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens},
        "stats": stats | {"tokens_per_step": round(r.stats.tokens_per_step, 3)},
    }
    return json.dumps(out, ensure_ascii=False)
