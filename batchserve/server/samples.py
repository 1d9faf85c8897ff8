"""The samples of one call (OpenAI's `n` and `best_of`): their ids and seeds, one prompt scoring
for all of them, and their outputs merged as they come."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from batchserve.async_engine import RequestStream
from batchserve.request import RequestOutput, SamplingParams, TokenLogprob

# Output logprobs a call may ask for: samples x max_tokens x (top logprobs + 1), each a rendered
# object (about 400 bytes and microseconds of the one render thread): about 200 MB at most. Both
# front ends check it before a call is queued.
MAX_OUTPUT_LOGPROBS = 1 << 19
# Echo with logprobs holds each scored prompt position's alternatives (about 0.2 KB of objects and
# 35 bytes of JSON apiece); a call scores at most this many: prompt tokens x (logprobs + 1) x samples.
MAX_PROMPT_SCORES = 1 << 19


def samples_of(request_id: str, sampling: SamplingParams, n: int) -> list[tuple[str, SamplingParams]]:
    """The request id and parameters of each of `n` samples (one: the request itself). Sample i
    is seeded with seed + i where a seed is given; only sample 0 scores the prompt (echo's prompt
    logprobs): the others reuse its KV blocks and get its scores (`share_prompt_scores`)."""
    if n == 1:
        return [(request_id, sampling)]
    seed = sampling.seed
    return [
        (
            f"{request_id}-{i}",
            replace(
                sampling,
                seed=None if seed is None else (seed + i) % 2**64,
                prompt_logprobs=sampling.prompt_logprobs if i == 0 else None,
            ),
        )
        for i in range(n)
    ]


async def share_prompt_scores(
    outputs: AsyncIterator[tuple[int, RequestOutput]], n: int
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`outputs` of `n` samples per prompt (index p * n + i), where sample 0 alone scored each
    prompt: every other sample's first output carries sample 0's prompt logprobs, and waits for
    them if it comes first (it never waits past sample 0's end, with or without scores)."""
    scores: dict[int, list[TokenLogprob] | None] = {}  # prompt -> sample 0's prompt logprobs, from its first output
    held: dict[int, list[tuple[int, RequestOutput]]] = {}  # prompt -> outputs waiting for them
    started: set[int] = set()

    def with_scores(i: int, out: RequestOutput) -> tuple[int, RequestOutput]:
        if i in started:
            return i, out
        started.add(i)
        return i, replace(out, prompt_logprobs=scores[i // n])

    try:
        async for i, out in outputs:
            p, k = divmod(i, n)
            if k == 0 and p not in scores:
                scores[p] = out.prompt_logprobs
                started.add(i)
                yield i, out
                for item in held.pop(p, []):
                    yield with_scores(*item)
            elif p in scores:
                yield with_scores(i, out)
            else:
                held.setdefault(p, []).append((i, out))
        for item in [item for waiting in held.values() for item in waiting]:  # sample 0 never answered
            yield item
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]


async def merged_outputs(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) of every stream as each arrives, until all have finished."""
    if len(streams) == 1:  # no task in between for the common case
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, out = await queue.get()
            if out is None:
                left -= 1
            else:
                yield i, out
    finally:
        for task in tasks:
            task.cancel()
