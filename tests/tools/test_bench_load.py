"""tools.bench.load sends a request again when a stale keep-alive connection drops it unanswered."""

from __future__ import annotations

import asyncio
import json

from tools.bench.load import run_level

CHUNK = json.dumps({"choices": [{"delta": {"content": "hi"}}]})
USAGE = json.dumps({"choices": [], "usage": {"completion_tokens": 2}})
BODY = f"data: {CHUNK}\n\ndata: {CHUNK}\n\ndata: {USAGE}\n\ndata: [DONE]\n\n".encode()


async def serve_closing_every_second_request(answered: list[int], dropped: list[int]):
    """One answer per connection, kept alive; the next request on it is cut unanswered."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            if served == 1:
                dropped.append(1)
                writer.close()
                return
            served += 1
            answered.append(1)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"content-length: %d\r\n\r\n" % len(BODY) + BODY)
            await writer.drain()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_a_request_cut_on_a_stale_connection_is_sent_again_and_counted_once():
    async def scenario():
        answered: list[int] = []
        dropped: list[int] = []
        server = await serve_closing_every_second_request(answered, dropped)
        port = server.sockets[0].getsockname()[1]
        async with server:
            report = await run_level(f"http://127.0.0.1:{port}", "m", concurrency=1, num_requests=4,
                                     max_tokens=2, prompt="p", ignore_eos=False, headers={})
        return report, answered, dropped

    report, answered, dropped = asyncio.run(scenario())
    assert dropped, "the server never cut a reused connection: the test proves nothing"
    assert report.requests == 4 and report.failed == 0
    assert len(answered) == 4
    assert report.output_tok_s > 0
