"""Drive a streamer (chat, completions, /lm/v2) over recorded worker chunks, without a server."""

from __future__ import annotations

import asyncio
import json

from workers.contract.chunks import GenerationChunk


def sse_lines(streamer, chunks: list[GenerationChunk]) -> list[str]:
    """The SSE lines `streamer.events` writes when the worker sends `chunks`."""

    async def rest():
        for chunk in chunks[1:]:
            yield chunk

    async def collect():
        return [line async for line in streamer.events(chunks[0], rest())]

    return asyncio.run(collect())


def sse_payloads(streamer, chunks: list[GenerationChunk]) -> list[dict]:
    """The JSON payloads of those lines; the stream must end with `data: [DONE]`."""
    lines = sse_lines(streamer, chunks)
    assert lines[-1] == "data: [DONE]\n\n"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]
