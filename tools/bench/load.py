"""Load generator: N streaming chat requests at concurrency C against an OpenAI-style server.

    python -m tools.bench.load --url http://127.0.0.1:8000 --concurrency 1 16 32 --num-requests 64

Prints, per concurrency level: output tok/s, TTFT and TPOT (median and p99). TTFT is
time to the first content event; TPOT is (last event - first event) / (tokens - 1).
Token counts come from the final usage chunk when the server sends one, else from the
number of content events. Loopback targets only: the loop is bounded by --num-requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import httpx
from tqdm import tqdm

DEFAULT_PROMPT = "Write a long story about a robot who learns to paint. Use vivid detail."


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    tokens: int = 0
    error: str = ""


@dataclass
class LevelReport:
    concurrency: int
    requests: int
    failed: int
    wall_s: float
    output_tok_s: float
    ttft_median_ms: float
    ttft_p99_ms: float
    tpot_median_ms: float
    tpot_p99_ms: float

    def line(self) -> str:
        return (
            f"c={self.concurrency:<3} n={self.requests:<4} failed={self.failed:<3} "
            f"tok/s={self.output_tok_s:8.1f}  TTFT med={self.ttft_median_ms:8.1f} ms p99={self.ttft_p99_ms:8.1f} ms  "
            f"TPOT med={self.tpot_median_ms:7.1f} ms p99={self.tpot_p99_ms:7.1f} ms"
        )


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    # A server may close an idle keep-alive connection just as the pool hands it out
    # (llama-server's HTTP library does, after a few requests on one connection): the
    # request then fails before any response. Clients (the OpenAI SDK) send it again on a
    # fresh connection; so does this one, once, so the peer is not charged for the race.
    start = time.perf_counter()
    result = await _stream_request(client, url, body, start)
    if result.error.startswith(_STALE_CONNECTION):
        result = await _stream_request(client, url, body, start)
    return result


_STALE_CONNECTION = "RemoteProtocolError('Server disconnected without sending a response"


async def _stream_request(client: httpx.AsyncClient, url: str, body: dict, start: float) -> RequestResult:
    first = last = None
    events = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                return RequestResult(False, error=f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    return RequestResult(False, error=str(payload["error"]))
                if payload.get("usage"):
                    usage_tokens = payload["usage"].get("completion_tokens")
                choices = payload.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    events += 1
    except httpx.HTTPError as exc:
        return RequestResult(False, error=repr(exc))
    if first is None:
        return RequestResult(False, error="no content")
    tokens = usage_tokens or events
    tpot = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    return RequestResult(True, ttft_s=first - start, tpot_s=tpot, tokens=tokens)


async def run_level(url: str, model: str, concurrency: int, num_requests: int, max_tokens: int,
                    prompt: str, ignore_eos: bool, headers: dict[str, str], temperature: float = 0.8) -> LevelReport:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": temperature,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    results: list[RequestResult] = []
    queue = list(range(num_requests))
    bar = tqdm(total=num_requests, desc=f"c={concurrency}", leave=False)

    async with httpx.AsyncClient(timeout=600, limits=limits, headers=headers) as client:
        async def worker() -> None:
            while queue:
                queue.pop()
                results.append(await one_request(client, url + "/v1/chat/completions", body))
                bar.update(1)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    bar.close()
    ok = [r for r in results if r.ok]
    for r in results:
        if not r.ok:
            print("failed:", r.error)
    ttfts = [r.ttft_s * 1000 for r in ok]
    tpots = [r.tpot_s * 1000 for r in ok if r.tokens > 1]
    return LevelReport(
        concurrency=concurrency,
        requests=len(results),
        failed=len(results) - len(ok),
        wall_s=wall,
        output_tok_s=sum(r.tokens for r in ok) / wall,
        ttft_median_ms=statistics.median(ttfts) if ttfts else float("nan"),
        ttft_p99_ms=percentile(ttfts, 99),
        tpot_median_ms=statistics.median(tpots) if tpots else float("nan"),
        tpot_p99_ms=percentile(tpots, 99),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--num-requests", type=int, default=None, help="per level; default 2 x concurrency, >= 8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--no-ignore-eos", action="store_true", help="for servers that reject ignore_eos")
    parser.add_argument("--json", default=None, help="also write the reports here")
    parser.add_argument("--api-key", default=os.environ.get("CHATSERVE_API_KEY"),
                        help="sent as a Bearer token (default: $CHATSERVE_API_KEY)")
    args = parser.parse_args(argv)

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or httpx.get(args.url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    reports = []
    for concurrency in args.concurrency:
        n = args.num_requests or max(8, 2 * concurrency)
        report = asyncio.run(run_level(args.url, model, concurrency, n, args.max_tokens, args.prompt,
                                       not args.no_ignore_eos, headers, args.temperature))
        print(report.line(), flush=True)
        reports.append(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"url": args.url, "model": model, "max_tokens": args.max_tokens,
                       "levels": [asdict(r) for r in reports]}, f, indent=2)


if __name__ == "__main__":
    main()
