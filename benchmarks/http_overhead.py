"""What the OpenAI HTTP front end costs per request next to gRPC, in one run on one server.

Loads the default model into one in-process server with both front ends, then sends the same
prompts one at a time (no queueing), alternating gRPC `StreamGenerate` and a streamed HTTP
`/v1/completions`, greedy, and records each call's time to the first token and to the end.

    .venv/bin/python benchmarks/http_overhead.py --num-prompts 24 --max-tokens 16 --out benchmarks/results/http-overhead
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import openai

from batchserve.async_engine import AsyncEngine
from batchserve.bench.datasets import humaneval
from batchserve.engine import EngineCore
from batchserve.server.app import BatchServer, ServerConfig
from batchserve.server.client import build_request
from batchserve.server.http import listen
from batchserve.v1 import generation_pb2_grpc as pb_grpc


async def _grpc(stub: pb_grpc.TextGenerationStub, prompt: str, max_tokens: int) -> tuple[float, float, str]:
    start = time.perf_counter()
    first, text = None, []
    async for chunk in stub.StreamGenerate(build_request(prompt, max_new_tokens=max_tokens, ignore_eos=True)):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - start
        text.append(chunk.text)
    return first or 0.0, time.perf_counter() - start, "".join(text)


async def _http(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> tuple[float, float, str]:
    start = time.perf_counter()
    first, text = None, []
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - start
        text.append(chunk.choices[0].text if chunk.choices else "")
    return first or 0.0, time.perf_counter() - start, "".join(text)


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50_ms": round(1e3 * statistics.median(xs), 2), "p90_ms": round(1e3 * xs[int(0.9 * (len(xs) - 1))], 2)}


async def main(num_prompts: int, max_tokens: int, out: Path) -> None:
    import grpc

    core = EngineCore()  # the default model and settings, as `batchserve serve` has them
    sock = listen("127.0.0.1", 0)
    server = BatchServer(AsyncEngine(core), ServerConfig(port=0, http_port=0), model_name="model", http_socket=sock)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.TextGenerationStub(channel)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused")
    prompts = [s.prompt for s in humaneval()[:num_prompts]]
    try:
        await _grpc(stub, prompts[0], 2)  # warm both paths once
        await _http(client, "model", prompts[0], 2)
        rows: dict[str, list[tuple[float, float]]] = {"grpc": [], "http": []}
        same = 0
        for i, prompt in enumerate(prompts):  # alternate which goes first, so drift hits both
            calls = [("grpc", _grpc(stub, prompt, max_tokens)), ("http", _http(client, "model", prompt, max_tokens))]
            texts = {}
            for name, call in calls if i % 2 == 0 else calls[::-1]:
                ttft, total, texts[name] = await call
                rows[name].append((ttft, total))
            same += texts["grpc"] == texts["http"]
    finally:
        await channel.close()
        await server.shutdown()
    result = {
        "num_prompts": num_prompts,
        "max_tokens": max_tokens,
        "same_text": same,
        **{name: {"ttft": _stats([t for t, _ in r]), "total": _stats([e for _, e in r])} for name, r in rows.items()},
    }
    result["ttft_p50_overhead_ms"] = round(result["http"]["ttft"]["p50_ms"] - result["grpc"]["ttft"]["p50_ms"], 2)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/http-overhead"))
    args = ap.parse_args()
    asyncio.run(main(args.num_prompts, args.max_tokens, args.out))
