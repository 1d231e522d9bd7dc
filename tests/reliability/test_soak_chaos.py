"""The chaos soak (tools/reliability/soak.py `--kill-worker-every`): a short one on the tiny
model with a worker replica killed mid-load loses and fails nothing, its requests resumed
on the other replica; and, without Ray, the pause measurement, the kill schedule and the
refusal of chaos with one replica. `make soak-chaos` runs the long one on the default model."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from serve_app.app import worker_deployment_name
from tests.support.serve_fixtures import (
    TINY_MODEL_ID,
    delete_app,
    run_app,
    soak_app_args,
)
from tools.reliability.replicas import with_worker_replicas
from tools.reliability.soak import (
    COMPLETED,
    FAILED,
    LOST,
    Kill,
    Outcome,
    PauseClock,
    ServeProbe,
    SoakConfig,
    WorkerKiller,
    parse_args,
    pauses,
    send,
    soak,
)

APP = "chaos"


@pytest.fixture(scope="module")
def chaos_app(serve_instance, tmp_path_factory):
    # The soak's app, with two worker replicas of one torch thread each. Power of two
    # choices rather than prefix-aware routing: the soak's few prompts could all go to one
    # replica, leaving none in flight on the one killed (then nothing would resume and the
    # test would prove nothing).
    args = with_worker_replicas(soak_app_args(tmp_path_factory.mktemp("chaos_model")), 2)
    args["models"][0]["routing"] = {"prefix_aware": False}
    yield run_app(serve_instance, APP, args)
    delete_app(APP)


def test_a_short_chaos_soak_loses_nothing_and_resumes_the_killed_replicas_requests(chaos_app):
    # 64-token answers keep ~8 requests in flight, on both replicas, when the kill lands at 6 s;
    # the interval outlasts the load: exactly one kill.
    config = SoakConfig(url=chaos_app, model=TINY_MODEL_ID, concurrency=8, duration_s=20, max_tokens=64,
                        request_timeout_s=120, settle_timeout_s=30)
    killer = WorkerKiller(APP, worker_deployment_name(TINY_MODEL_ID), every_s=60, first_s=6, replace_timeout_s=60)
    result = asyncio.run(soak(config, ServeProbe(APP, TINY_MODEL_ID), killer))
    print(result.summary())
    assert result.kills == 1 and result.chaos["worker_replicas"] == 2
    assert result.chaos["kills"][0]["replaced_s"] is not None  # Serve replaced it: the killer waited for that
    assert result.lost == 0, result.lost_details
    assert result.failed == 0, result.failures
    assert result.completed >= 30
    assert result.resumes is not None and result.resumes >= 1  # the killed replica had requests in flight
    assert result.streams_timed > 0 and result.longest_pause_s > 0
    assert result.pause_p99_s <= result.longest_pause_s
    assert result.longest_completed_pause_s == result.longest_pause_s  # every stream completed


# ------------------------------------------------------------------ without Ray


def test_chaos_is_refused_with_one_worker_replica_or_a_running_server(capsys):
    with pytest.raises(SystemExit):  # configs/default.yaml has one worker replica
        parse_args(["--config", "configs/default.yaml", "--kill-worker-every", "60"])
    assert "at least 2 worker replicas" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--worker-replicas", "1", "--kill-worker-every", "60"])
    with pytest.raises(SystemExit):  # it could not kill a running server's replicas
        parse_args(["--url", "http://127.0.0.1:8000", "--worker-replicas", "2", "--kill-worker-every", "60"])
    args = parse_args(["--worker-replicas", "2", "--kill-worker-every", "60"])
    assert (args.worker_replicas, args.kill_worker_every) == (2, 60)


def test_worker_replicas_override_gives_each_one_thread_and_half_a_cpu():
    args = {"models": [{"id": "m", "engine": {"torch_threads": 4}, "deployment": {"num_replicas": 1}}]}
    changed = with_worker_replicas(args, 2)
    assert changed["models"][0]["deployment"] == {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}}
    assert changed["models"][0]["engine"]["torch_threads"] == 1
    assert args["models"][0]["deployment"] == {"num_replicas": 1}  # the caller's args are left alone


def test_pause_clock_keeps_the_longest_gap_and_when_it_began():
    clock = PauseClock(10.0)
    for now in (10.5, 10.6, 13.1, 13.2):
        clock.tick(now)
    assert clock.longest == pytest.approx(2.5) and clock.began == 10.6


def sse_client(gaps_s: list[float], cut_after_s: float | None = None) -> httpx.AsyncClient:
    """A client whose server answers a stream of one event after each gap, then [DONE]
    (or, `cut_after_s` given, that long a silence, then the connection closes)."""
    async def events():
        for i, gap in enumerate(gaps_s):
            await asyncio.sleep(gap)
            finish = "stop" if i == len(gaps_s) - 1 else None
            event = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": finish}]}
            yield f"data: {json.dumps(event)}\n\n".encode()
        if cut_after_s is not None:
            await asyncio.sleep(cut_after_s)
        else:
            yield b"data: [DONE]\n\n"

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def stream_once(gaps_s: list[float], cut_after_s: float | None = None) -> Outcome:
    async with sse_client(gaps_s, cut_after_s) as client:
        body = {"model": "m", "messages": [], "stream": True}
        return await send(client, "http://sse", "chat_stream", "/v1/chat/completions", body, 0)


def test_a_streams_longest_pause_is_measured_from_its_start_between_its_events():
    outcome = asyncio.run(stream_once([0.05, 0.4, 0.05]))
    assert outcome.result == COMPLETED
    assert 0.38 <= outcome.longest_pause_s < 0.6  # the 0.4 s gap between the first and second event
    first = asyncio.run(stream_once([0.3, 0.01]))
    assert 0.28 <= first.longest_pause_s < 0.5  # start -> first event counts too
    assert first.pause_began == first.started


def test_a_cut_stream_counts_the_silence_before_the_cut():
    outcome = asyncio.run(stream_once([0.01, 0.05], cut_after_s=0.3))  # events at ~0.01 s and ~0.06 s
    assert outcome.result == LOST and 0.28 <= outcome.longest_pause_s < 0.5
    assert outcome.pause_began - outcome.started >= 0.05  # it began at the last event


def test_pauses_are_the_longest_over_the_streams_and_the_p99_of_each_ones_longest():
    def stream(started: float, longest: float | None, began: float = 0.0) -> Outcome:
        return Outcome("chat_stream", COMPLETED, 200, started=started, longest_pause_s=longest, pause_began=began)

    failed = Outcome("chat_stream", FAILED, 200, started=104.0, longest_pause_s=60.0, pause_began=110.0)
    outcomes = [stream(100.0, 0.2, 100.0), stream(101.0, 4.0, 160.5), stream(102.0, 0.3, 102.1),
                Outcome("chat", COMPLETED, 200, started=103.0)]  # not a stream: not timed
    paused = pauses(outcomes)
    assert (paused.streams, paused.longest_s, paused.longest_at_s) == (3, 4.0, 60.5)
    assert paused.p99_s == 4.0 and paused.longest_completed_s == 4.0
    with_failed = pauses([*outcomes, failed])  # a stream that waited 60 s for its error event
    assert (with_failed.longest_s, with_failed.longest_at_s, with_failed.longest_completed_s) == (60.0, 10.0, 4.0)
    assert pauses([Outcome("chat", COMPLETED, 200)]).longest_s is None


class TimedKiller(WorkerKiller):
    """The schedule of WorkerKiller with the kill replaced: each 'replacement' takes `replace_s`."""

    def __init__(self, every_s: float, first_s: float, replace_s: list[float | None]) -> None:
        super().__init__("app", "worker", every_s, first_s)
        self.replace_s = replace_s
        self.at: list[float] = []

    def _kill_one(self, start: float, replicas: int) -> Kill:
        self.at.append(time.monotonic() - start)
        wait = self.replace_s[len(self.at) - 1]
        time.sleep(wait or 0.05)
        return Kill(round(self.at[-1], 3), f"r{len(self.at)}", wait)


def test_the_next_kill_waits_for_the_interval_or_the_replacement_whichever_is_later():
    # every 0.2 s, but the first replacement takes 0.45 s: the second kill waits for it
    killer = TimedKiller(every_s=0.2, first_s=0.1, replace_s=[0.45, 0.05, 0.05, 0.05])
    kills = asyncio.run(killer.run(duration_s=0.9, replicas=2))
    assert [k.replica for k in kills] == ["r1", "r2", "r3"]
    assert killer.at[0] == pytest.approx(0.1, abs=0.05)
    assert killer.at[1] - killer.at[0] >= 0.45  # the replacement, later than the interval
    assert killer.at[2] - killer.at[1] == pytest.approx(0.2, abs=0.05)  # the interval, later than the replacement


def test_no_kill_follows_one_whose_replica_was_not_replaced():
    killer = TimedKiller(every_s=0.1, first_s=0.05, replace_s=[None, 0.05])
    kills = asyncio.run(killer.run(duration_s=1.0, replicas=2))
    assert [(k.replica, k.replaced_s) for k in kills] == [("r1", None)]
