"""RouterCore stepped directly: FIFO admission, giving a place up, event ordering, capacity, restarts."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import zmq.asyncio

from common.ipc.transport import AsyncInbox, ipc_address, make_run_dir, pair_names
from common.metrics import RouterMetrics, new_registry
from common.model.defaults import default_model_dir
from common.model.synthetic.checkpoint import make_model
from common.openai.api import ApiError
from common.protocol import (
    Abort,
    Encode,
    Generate,
    Heartbeat,
    PairMoved,
    Ready,
    SamplingParams,
    ServiceDown,
    Tokens,
)
from services.router import RouterConfig, RouterCore, WorkerPair

SAMPLING = SamplingParams(max_tokens=8)


def run_core(
    test: Callable[[RouterCore], Awaitable[None]], announce: bool = True, pairs: int = 1, **overrides: Any
) -> None:
    """Run `test` against a started core whose pairs' inboxes (ipc://RUN_DIR/NAME.sock) nobody binds."""
    run_dir = make_run_dir()
    addresses = [[ipc_address(run_dir, name) for name in pair_names(i)] for i in range(pairs)]
    config = RouterConfig(
        model_dir=default_model_dir(),
        inbox=ipc_address(run_dir, "router"),
        pairs=[WorkerPair(*pair) for pair in addresses],
    )
    config = dataclasses.replace(config, **overrides)

    async def main() -> None:
        core = RouterCore(config, RouterMetrics.create(new_registry()))
        await core.start()
        try:
            for service in core.services if announce else ():
                core.on_message(Ready(service, os.getpid(), capacity=2))
            await test(core)
        finally:
            await core.close()

    try:
        asyncio.run(main())
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_fifo_admission_and_giving_up_a_place() -> None:
    async def test(core: RouterCore) -> None:
        first = await core.submit([1, 2], SAMPLING, time.monotonic())
        second = asyncio.create_task(core.submit([3], SAMPLING, time.monotonic()))
        third = asyncio.create_task(core.submit([4], SAMPLING, time.monotonic()))
        await settle()
        assert core.health()["router"] == {"running": 1, "waiting": 2, "max_running": 1, "max_queue": 2}
        try:
            await core.submit([5], SAMPLING, time.monotonic())
            raise AssertionError("a full queue must refuse")
        except ApiError as exc:
            assert exc.status == 429
        third.cancel()
        await settle()
        assert core.health()["router"]["waiting"] == 1
        core.release(first, "stop")
        admitted = await second
        assert admitted.prompt_ids == [3] and core.health()["router"]["running"] == 1
        core.release(admitted, None)
        assert core.health()["router"] == {"running": 0, "waiting": 0, "max_running": 1, "max_queue": 2}

    run_core(test, max_running=1, max_queue=2)


def test_capacity_from_ready_sets_the_limit() -> None:
    async def test(core: RouterCore) -> None:
        assert core.max_running() == 2
        flights = [await core.submit([1], SAMPLING, time.monotonic()) for _ in range(2)]
        waiter = asyncio.create_task(core.submit([1], SAMPLING, time.monotonic()))
        await settle()
        assert not waiter.done()
        core.on_message(Ready("decode", os.getpid(), capacity=3))
        await settle()
        assert not waiter.done(), "the smallest capacity counts"
        core.on_message(Ready("prefill", os.getpid(), capacity=3))  # more room: the waiter starts
        flights.append(await asyncio.wait_for(waiter, 5))
        for flight in flights:
            core.release(flight, None)

    run_core(test, max_running=0)


def test_events_are_delivered_in_index_order() -> None:
    async def test(core: RouterCore) -> None:
        flight = await core.submit([1], SAMPLING, time.monotonic())
        core.on_message(Tokens(flight.rid, [7, 8], "stop", index=3))
        core.on_message(Tokens(flight.rid, [5, 6], index=1))
        assert flight.events.empty(), "nothing before the first token"
        core.on_message(Tokens(flight.rid, [4], index=0))
        core.on_message(Tokens(flight.rid, [4], index=0))  # a duplicate is dropped
        got = [await flight.next_event() for _ in range(3)]
        assert [e.token_ids for e in got] == [[4], [5, 6], [7, 8]] and flight.events.empty()
        assert flight.worker_done
        core.release(flight, "stop")
        core.on_message(Tokens(flight.rid, [9], index=5))  # late events of a finished request are ignored

    run_core(test)


def test_a_gap_in_the_events_past_its_timeout_fails_the_request_once() -> None:
    async def test(core: RouterCore) -> None:
        flight = await core.submit([1], SAMPLING, time.monotonic())
        core.on_message(Tokens(flight.rid, [4], index=0))
        core.on_message(Tokens(flight.rid, [6], index=2))  # index 1 is lost
        assert (await flight.next_event()).token_ids == [4]
        core.check_stalls()
        assert flight.events.empty(), "a gap within the timeout is a reordering"
        core.on_message(Tokens(flight.rid, [5], index=1))
        assert [(await flight.next_event()).token_ids for _ in range(2)] == [[5], [6]]
        assert flight.gap_since is None
        core.on_message(Tokens(flight.rid, [8], index=4))  # index 3 is lost for good
        flight.gap_since -= 31
        core.check_stalls()
        core.check_stalls()  # once, not once a tick
        event = await flight.next_event()
        assert event.finish_reason == "error" and "lost" in event.error and "index 3" in event.error
        core.on_message(Tokens(flight.rid, [7], index=3))  # too late: dropped
        assert flight.events.empty() and not flight.pending
        core.release(flight, None)
        assert core.health()["router"]["running"] == 0

    run_core(test, event_gap_timeout_s=30)


def test_the_watchdog_fails_a_request_whose_event_was_lost() -> None:
    async def test(core: RouterCore) -> None:
        flight = await core.submit([1], SAMPLING, time.monotonic())
        core.on_message(Tokens(flight.rid, [6], index=1))  # the first token is lost
        event = await asyncio.wait_for(flight.next_event(), 5)
        assert event.finish_reason == "error" and "index 0" in event.error
        core.release(flight, None)

    run_core(test, stall_timeout_s=0, event_gap_timeout_s=0.2)


def test_errors_overtake_tokens_and_restarts_fail_flights() -> None:
    async def test(core: RouterCore) -> None:
        a = await core.submit([1], SAMPLING, time.monotonic())
        b = await core.submit([1], SAMPLING, time.monotonic())
        core.on_message(Tokens(a.rid, [], "error", error="boom", index=4))
        assert (await a.next_event()).error == "boom"
        core.on_message(Ready("prefill", os.getpid() + 1, capacity=2))
        event = await b.next_event()
        assert event.finish_reason == "error" and "restarted" in event.error
        assert core.health()["services"]["prefill"]["restarts"] == 1
        core.release(a, None)
        core.release(b, None)

    run_core(test)


def test_a_restart_under_the_same_pid_is_told_by_its_instance() -> None:
    """In a container every start of a worker gets the same pid: the start id tells them apart."""

    async def test(core: RouterCore) -> None:
        pid = os.getpid()
        core.on_message(Ready("decode", pid, capacity=2, instance="a"))
        restarts = core.health()["services"]["decode"]["restarts"]
        flight = await core.submit([1], SAMPLING, time.monotonic())
        core.on_message(Heartbeat("decode", pid, instance="a"))
        assert flight.events.empty(), "the same process"
        core.on_message(Ready("decode", pid, capacity=2, instance="b"))
        event = await flight.next_event()
        assert event.finish_reason == "error" and "restarted" in event.error
        assert core.health()["services"]["decode"]["restarts"] == restarts + 1
        core.release(flight, None)
        core.on_message(ServiceDown("decode", pid, -9))
        core.on_message(Heartbeat("decode", pid, instance="b"))  # late, from the dead one
        assert core.health()["services"]["decode"]["state"] == "down"
        core.on_message(Ready("decode", pid, capacity=2, instance="c"))  # its successor, same pid
        assert core.health()["services"]["decode"]["state"] == "up"

    run_core(test)


def test_a_closed_connection_fails_flights_and_the_service_waits_to_be_heard() -> None:
    async def test(core: RouterCore) -> None:
        state = lambda: core.health()["services"]["decode"]["state"]
        core.on_link("decode", True)
        flight = await core.submit([1], SAMPLING, time.monotonic())
        core.on_link("decode", False)
        event = await flight.next_event()
        assert event.finish_reason == "error" and "connection closed" in event.error
        core.release(flight, None)
        assert state() == "down"
        core.on_message(Heartbeat("decode", os.getpid()))  # sent before the connection closed
        core.on_link("decode", True)
        assert state() == "starting", "nothing heard from the process behind the new connection"
        core.on_message(Heartbeat("decode", os.getpid()))
        assert state() == "up"

    run_core(test)


def test_workers_leaving_as_the_router_stops_are_no_error(caplog: pytest.LogCaptureFixture) -> None:
    """A signal stops the router and its workers together (Ctrl-C): their exits are logged as information;
    the first pair up is logged once as the router's readiness."""

    async def test(core: RouterCore) -> None:
        for name in ("prefill", "decode"):
            core.on_message(Ready(name, os.getpid(), capacity=2))
        core.on_message(Heartbeat("decode", os.getpid()))
        assert [r.message for r in caplog.records].count("ready: pair 0 is up and requests are served") == 1
        core.on_link("decode", True)
        core.supervisor.stopping = True
        core.on_link("decode", False)
        core.on_message(ServiceDown("prefill", os.getpid(), -2))
        ends = [r for r in caplog.records if "connection closed" in r.message or "exited" in r.message]
        closed = [r for r in ends if not r.message.startswith("pair ")]
        assert len(closed) == 2 and all(r.levelno == logging.INFO for r in ends)

    with caplog.at_level(logging.INFO, logger="services.router.supervision"):
        run_core(test)


def test_a_stall_fails_flights_once_until_heard_again() -> None:
    async def test(core: RouterCore) -> None:
        flight = await core.submit([1], SAMPLING, time.monotonic())
        core.check_stalls()
        assert flight.events.empty(), "heard within the timeout"
        core.services["decode"].last_seen = time.monotonic() - 61
        core.check_stalls()
        core.check_stalls()  # once a stall, not once a tick
        event = await flight.next_event()
        assert event.finish_reason == "error" and "stopped responding" in event.error
        assert flight.events.empty() and core.health()["services"]["decode"]["state"] == "down"
        core.release(flight, None)
        core.on_message(Heartbeat("decode", os.getpid()))
        assert core.ready() and not core.services["decode"].stalled

    run_core(test, stall_timeout_s=60)


def test_the_watchdog_fails_flights_of_a_silent_worker() -> None:
    async def test(core: RouterCore) -> None:
        flight = await core.submit([1], SAMPLING, time.monotonic())  # no heartbeat follows the Ready
        event = await asyncio.wait_for(flight.next_event(), 5)
        assert event.finish_reason == "error" and "stopped responding" in event.error
        core.release(flight, None)

    run_core(test, stall_timeout_s=0.3)


def test_a_request_queued_behind_a_dead_worker_is_refused() -> None:
    """The worker's death frees the slots: the requests that waited for them get 503, not the dead worker."""

    async def test(core: RouterCore) -> None:
        first = await core.submit([1], SAMPLING, time.monotonic())
        waiter = asyncio.create_task(core.submit([2], SAMPLING, time.monotonic()))
        await settle()
        core.on_message(ServiceDown("decode", os.getpid(), -9))
        assert (await first.next_event()).finish_reason == "error"
        core.release(first, None)
        try:
            await asyncio.wait_for(waiter, 5)
            raise AssertionError("a request must not start while a worker is down")
        except ApiError as exc:
            assert exc.status == 503 and exc.code == "not_ready"
        assert core.health()["router"]["running"] == 0 and core.health()["router"]["waiting"] == 0

    run_core(test, max_running=1)


def test_the_context_limit_is_the_smallest_announced() -> None:
    async def test(core: RouterCore) -> None:
        assert core.context_limit(256) == 256, "Ready without a context of its own"
        core.on_message(Ready("decode", os.getpid(), capacity=2, max_context=100))
        assert core.context_limit(256) == 100 and core.context_limit(64) == 64

    run_core(test)


def test_a_restarted_router_learns_the_limits_from_heartbeats() -> None:
    """A router restarted after the workers' Ready: their heartbeats carry what Ready said."""

    async def test(core: RouterCore) -> None:
        assert core.context_limit(256) == 256
        core.on_message(Heartbeat("decode", os.getpid(), capacity=5, max_context=100))
        assert core.services["decode"].capacity == 5 and core.context_limit(256) == 100

    run_core(test, announce=False)


def test_requests_go_to_the_least_loaded_pair() -> None:
    async def test(core: RouterCore) -> None:
        for name in ("prefill-1", "decode-1"):
            core.on_message(Ready(name, os.getpid(), capacity=4))
        assert core.max_running() == 6 and core.status() == "ok"
        flights = [await core.submit([1], SAMPLING, time.monotonic()) for _ in range(6)]
        assert sorted(f.pair for f in flights) == [0, 0, 1, 1, 1, 1], "each pair to its capacity"
        assert [(p["state"], p["running"], p["capacity"]) for p in core.health()["pairs"]] == [
            ("up", 2, 2),
            ("up", 4, 4),
        ]
        for flight in flights:
            core.release(flight, None)
        assert [p.running for p in core.pairs] == [0, 0]

    run_core(test, pairs=2, max_running=0)


def test_a_pair_going_down_fails_its_requests_only_and_the_others_serve() -> None:
    async def test(core: RouterCore) -> None:
        a, b = [await core.submit([1], SAMPLING, time.monotonic()) for _ in range(2)]
        assert (a.pair, b.pair) == (0, 1)
        core.on_message(ServiceDown("decode-1", os.getpid(), -9))
        event = await b.next_event()
        assert event.finish_reason == "error" and "decode-1 worker exited" in event.error
        core.release(b, None)
        assert a.events.empty(), "the other pair's request runs on"
        assert core.status() == "degraded" and core.ready() and core.max_running() == 2
        c = await core.submit([1], SAMPLING, time.monotonic())
        assert c.pair == 0, "only the pair that is up takes requests"
        core.on_link("prefill", True)
        core.on_link("prefill", False)
        assert (await a.next_event()).finish_reason == "error" and (
            await c.next_event()
        ).finish_reason == "error"
        assert core.status() == "unavailable"
        core.release(a, None)
        core.release(c, None)
        core.on_message(Ready("decode-1", os.getpid() + 1, capacity=2))
        assert core.status() == "degraded" and core.up_pairs() == [core.pairs[1]]

    run_core(test, pairs=2, max_running=0)


def test_a_worker_of_no_pair_is_ignored() -> None:
    """A worker started with another router's names must not count as up here, nor fail requests."""

    async def test(core: RouterCore) -> None:
        flight = await core.submit([1], SAMPLING, time.monotonic())
        core.on_message(Ready("decode-3", os.getpid() + 1, capacity=9))
        core.on_message(ServiceDown("decode-3", os.getpid() + 1, -9))
        assert flight.events.empty() and "decode-3" not in core.health()["services"]
        assert core.max_running() == 2
        core.release(flight, None)

    run_core(test, max_running=0)


def test_each_request_and_its_abort_go_to_its_own_pair() -> None:
    """Over real sockets: each pair's workers get the Generate and the Abort of their requests only."""

    async def test(core: RouterCore) -> None:
        ctx = zmq.asyncio.Context()
        inboxes = [[AsyncInbox(address, ctx) for address in (p.prefill, p.decode)] for p in core.config.pairs]
        try:
            flights = [await core.submit([i], SAMPLING, time.monotonic()) for i in range(2)]
            for flight in flights:
                core.release(flight, None)  # not finished by the workers: aborted at its pair
            for flight, (prefill, decode) in zip(flights, inboxes, strict=True):
                generate, abort = [await asyncio.wait_for(prefill.recv(), 5) for _ in range(2)]
                assert isinstance(generate, Generate) and (generate.rid, generate.prompt_ids) == (
                    flight.rid,
                    flight.prompt_ids,
                )
                assert abort == Abort(flight.rid)
                assert await asyncio.wait_for(decode.recv(), 5) == Abort(flight.rid)
            for box in (box for pair in inboxes for box in pair):
                assert await box.sock.poll(timeout=100) == 0, "nothing else"
        finally:
            for box in (box for pair in inboxes for box in pair):
                box.close()
            ctx.destroy(linger=0)

    run_core(test, pairs=2, max_running=0)


def test_a_pair_back_up_takes_the_waiting_requests() -> None:
    """A pair heard again after a stall raises the limit: the requests waiting start on it."""

    async def test(core: RouterCore) -> None:
        flights = [await core.submit([1], SAMPLING, time.monotonic()) for _ in range(2)]
        assert sorted(f.pair for f in flights) == [0, 1]
        core.services["decode-1"].last_seen = time.monotonic() - 61
        core.check_stalls()  # pair 1's request fails; pair 0 keeps its own
        (stalled,) = [f for f in flights if f.pair == 1]
        assert (await stalled.next_event()).finish_reason == "error"
        core.release(stalled, None)
        more = [asyncio.create_task(core.submit([2], SAMPLING, time.monotonic())) for _ in range(3)]
        await settle()
        assert core.max_running() == 2 and sum(t.done() for t in more) == 1, "pair 0's second slot only"
        core.on_message(Heartbeat("decode-1", os.getpid()))  # heard again: pair 1 is up
        started = [await asyncio.wait_for(t, 5) for t in more]
        assert sorted(f.pair for f in started) == [0, 1, 1]
        for flight in [*flights[:1], *started]:
            core.release(flight, None)

    run_core(test, pairs=2, max_running=0, stall_timeout_s=60)


def test_requests_of_a_silent_pair_keep_their_slots() -> None:
    """A pair down by missed heartbeats (not failed yet) holds its requests' slots beside the up pairs'."""

    async def test(core: RouterCore) -> None:
        a, b = [await core.submit([1], SAMPLING, time.monotonic()) for _ in range(2)]
        core.services["decode-1"].last_seen = time.monotonic() - 10  # past the heartbeat timeout
        assert core.status() == "degraded" and core.max_running() == 2 + 1
        c = await asyncio.wait_for(core.submit([1], SAMPLING, time.monotonic()), 5)
        assert (a.pair, b.pair, c.pair) == (0, 1, 0), "pair 0's free slot is used"
        for flight in (a, b, c):
            core.release(flight, None)

    run_core(test, pairs=2, max_running=0)


def test_images_go_to_the_encoder_and_its_failure_fails_only_their_requests() -> None:
    """A request with images: `Encode` to the encoder (naming the pair's prefill), `Generate` with their
    count to prefill, `Abort` to all three; an encoder that exits fails the requests still waiting for their
    embeddings (not those past their first token, nor those without images) and refuses new images with a
    503 while text is served, `degraded`. A text-only model's router waits for no encoder."""
    run_dir = make_run_dir()

    async def test(core: RouterCore) -> None:
        ctx = zmq.asyncio.Context()
        prefill, encoder = (AsyncInbox(a, ctx) for a in (core.config.pairs[0].prefill, core.config.encoder))
        try:
            assert core.health()["services"]["encoder"]["state"] == "up" and core.status() == "ok"
            core.check_images(10**6)  # no bound announced: the encoder refuses what it cannot hold
            core.on_message(Ready("encoder", os.getpid(), capacity=64, image_tokens=10))
            core.check_images(10)
            try:
                core.check_images(11)
                raise AssertionError("images past the encoder's rows must be refused")
            except ApiError as exc:
                assert exc.status == 400 and "at most 10" in exc.message
            flight = await core.submit([1, 2], SAMPLING, time.monotonic(), images=[b"png-1", b"png-2"])
            assert await asyncio.wait_for(encoder.recv(), 5) == Encode(
                flight.rid, [b"png-1", b"png-2"], "prefill"
            )
            generate = await asyncio.wait_for(prefill.recv(), 5)
            assert isinstance(generate, Generate) and generate.images == 2
            core.release(flight, None)
            assert await asyncio.wait_for(encoder.recv(), 5) == Abort(flight.rid)

            waiting = await core.submit([1], SAMPLING, time.monotonic(), images=[b"png"])
            started = await core.submit([1], SAMPLING, time.monotonic(), images=[b"png"])
            text = await core.submit([1], SAMPLING, time.monotonic())
            core.on_message(Tokens(started.rid, [9], index=0))
            core.on_message(ServiceDown("encoder", os.getpid(), -9))
            event = await asyncio.wait_for(waiting.next_event(), 5)
            assert event.finish_reason == "error" and "encoder" in event.error
            assert (await started.next_event()).token_ids == [9] and started.events.empty()
            assert text.events.empty()
            assert core.status() == "degraded"
            try:
                await core.submit([1], SAMPLING, time.monotonic(), images=[b"png"])
                raise AssertionError("images without an encoder must be refused")
            except ApiError as exc:
                assert exc.status == 503 and "encoder" in exc.message
            await core.submit([1], SAMPLING, time.monotonic())  # text still served
        finally:
            for box in (prefill, encoder):
                box.close()
            ctx.destroy(linger=0)

    run_core(lambda core: _no_encoder(core), encoder=ipc_address(run_dir, "encoder"))
    try:
        model_dir = make_model(run_dir / "q4", "tiny", "qwen4_exp")  # a vision tower: the encoder counts
        run_core(test, model_dir=model_dir, encoder=ipc_address(run_dir, "encoder"), max_running=8)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


async def _no_encoder(core: RouterCore) -> None:
    assert core.encoder is None and core.status() == "ok"


def test_an_undecodable_frame_is_dropped_and_counted_without_a_scrape(
    serve_router: Any, wait_until: Any
) -> None:
    """The count reaches the registry as the inbox reads on (what --metrics-port's server renders), not only
    when the API's /metrics is read."""
    import httpx
    import zmq

    from common.metrics import render

    with serve_router() as served:
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(served.config.inbox)
        try:
            push.send(b"\x00 not a message")
            registry = served.app.state.router.registry
            wait_until(lambda: b"spillway:dropped_frames_total 1.0" in render(registry)[0])
            assert httpx.get(f"{served.url}/health", timeout=5).json()["status"] == "ok"  # still serving
        finally:
            push.close(0)


def test_a_prefill_death_spares_the_requests_decode_holds() -> None:
    """Decode's event (index > 0) tells the router that decode holds a request: a prefill worker's exit,
    restart or closed connection fails only those still in prefill; a decode death fails them all."""

    async def test(core: RouterCore) -> None:
        decoding = await core.submit([1], SAMPLING, time.monotonic())
        prefilling = await core.submit([1], SAMPLING, time.monotonic())
        core.on_message(Tokens(decoding.rid, [5], index=0))
        core.on_message(Tokens(decoding.rid, [6], index=1))
        core.on_message(ServiceDown("prefill", os.getpid(), -9))
        event = await prefilling.next_event()
        assert event.finish_reason == "error" and "prefill worker exited" in event.error
        assert [(await decoding.next_event()).token_ids for _ in range(2)] == [[5], [6]]
        assert decoding.events.empty(), "decode still holds it: no error"
        core.on_message(Ready("prefill", os.getpid() + 1, capacity=2))  # its successor
        core.on_message(Tokens(decoding.rid, [7], "length", index=2))
        assert (await decoding.next_event()).finish_reason == "length"
        core.release(decoding, "length")
        core.release(prefilling, None)
        held = await core.submit([1], SAMPLING, time.monotonic())
        core.on_message(Tokens(held.rid, [6], index=1))  # decode's, ahead of prefill's first
        core.on_message(ServiceDown("decode", os.getpid(), -9))
        assert (await held.next_event()).finish_reason == "error", "decode's death fails what it holds"
        core.release(held, None)

    run_core(test)


def test_a_late_heartbeat_is_counted_and_a_silent_loop_is_a_stall() -> None:
    """A heartbeat past the heartbeat timeout is logged and counted; a worker heard (its beats' thread) whose
    loop has not come round for the stall timeout (`Heartbeat.loop_s`) is hung: its requests fail."""

    async def test(core: RouterCore) -> None:
        samples = lambda: core.metrics.late_heartbeats.collect()[0].samples
        late = lambda: {s.labels["service"]: s.value for s in samples() if s.name.endswith("_total")}
        core.on_message(Heartbeat("decode", os.getpid(), capacity=2))
        assert late() == {}, "in time"
        core.services["decode"].last_seen = time.monotonic() - 6
        core.on_message(Heartbeat("decode", os.getpid(), capacity=2))
        assert late() == {"decode": 1.0}
        flight = await core.submit([1], SAMPLING, time.monotonic())
        core.on_message(Heartbeat("decode", os.getpid(), capacity=2, loop_s=30))
        core.check_stalls()
        assert flight.events.empty() and core.ready(), "the loop is slow, not hung"
        core.on_message(Heartbeat("decode", os.getpid(), capacity=2, loop_s=61))
        assert core.ready(), "heard: up, until the stall check"
        core.check_stalls()
        event = await flight.next_event()
        assert event.finish_reason == "error" and "stopped responding" in event.error
        core.release(flight, None)

    run_core(test, stall_timeout_s=60)


def test_pair_states_are_logged_with_reasons_and_exported(caplog: pytest.LogCaptureFixture) -> None:
    """Each pair's changes of state are logged once (down: with the worker's reason) and exported as a state
    set and a count of changes; a 503 while no pair is up is logged with every pair's state."""

    async def test(core: RouterCore) -> None:
        def states() -> dict[tuple[str, str], float]:
            samples = core.metrics.pair_state.collect()[0].samples
            return {(s.labels["pair"], s.labels["state"]): s.value for s in samples if s.value}

        changes = lambda: {
            (s.labels["pair"], s.labels["state"]): s.value
            for s in core.metrics.pair_changes.collect()[0].samples
            if s.name.endswith("_total")
        }
        assert states() == {("0", "starting"): 1.0, ("1", "starting"): 1.0}
        for name in ("prefill", "decode"):
            core.on_message(Ready(name, os.getpid(), capacity=2))
        assert states() == {("0", "up"): 1.0, ("1", "starting"): 1.0}
        core.on_message(ServiceDown("decode", os.getpid(), -9))
        core.check_stalls()  # a tick: no change, no second line
        assert states() == {("0", "down"): 1.0, ("1", "starting"): 1.0}
        assert changes() == {
            ("0", "starting"): 1.0,
            ("0", "up"): 1.0,
            ("0", "down"): 1.0,
            ("1", "starting"): 1.0,
        }
        with pytest.raises(ApiError) as refused:
            await core.submit([1], SAMPLING, time.monotonic())
        assert refused.value.status == 503
        lines = [(r.levelno, r.message) for r in caplog.records if r.message.startswith(("pair ", "503"))]
        assert lines == [
            (logging.INFO, "pair 0 up"),
            (logging.ERROR, "pair 0 down (decode down: exited with code -9)"),
            (logging.WARNING, "503 not_ready: pair 0 down (decode down: exited with code -9); "
                              "pair 1 starting (prefill-1 starting: not heard from yet; "
                              "decode-1 starting: not heard from yet)"),
        ]  # fmt: skip

    with caplog.at_level(logging.INFO):
        run_core(test, announce=False, pairs=2)


def test_service_discovery_lists_each_worker_at_its_present_address() -> None:
    """`/metrics/targets` (Prometheus HTTP SD): a group a worker with a metrics URL, labelled with its role as
    the job and its pair; a restarted worker's announced address replaces the configured one."""

    async def test(core: RouterCore) -> None:
        def targets() -> dict[str, tuple[str, dict[str, str]]]:
            return {
                g["labels"]["service"]: (g["targets"][0], g["labels"])
                for g in core.supervisor.metrics_targets()
            }

        assert set(targets()) == {"prefill", "decode-1"}, "known: the configured URLs"
        labels = {"job": "decode", "service": "decode-1", "pair": "1", "model": core.config.model_name}
        labels["__metrics_path__"] = "/m"
        assert targets()["decode-1"] == ("decode-1.host:9402", {**labels, "__scheme__": "http"})
        core.on_message(
            Ready("decode-1", os.getpid(), capacity=2, metrics_url="http://10.0.0.7:23456/metrics")
        )
        core.on_message(
            Ready("decode", os.getpid(), capacity=2, metrics_url="https://10.0.0.8:23457/metrics")
        )
        found = targets()
        assert found["decode-1"][0] == "10.0.0.7:23456" and found["decode"][1]["__scheme__"] == "https"
        assert found["prefill"][1]["job"] == "prefill" and found["prefill"][1]["pair"] == "0"

    urls = {"prefill": "http://prefill.host:9401/metrics", "decode-1": "http://decode-1.host:9402/m"}
    run_core(test, announce=False, pairs=2, metrics_urls=urls)


def test_a_moved_pair_fails_what_it_held_and_is_reached_at_its_new_inboxes() -> None:
    """`PairMoved` (a Ray pair's host replaced): the pair's requests fail, the other pair's go on, its workers
    count as starting until they speak, and its next request reaches the new prefill inbox."""

    async def test(core: RouterCore) -> None:
        flights = [await core.submit([i], SAMPLING, time.monotonic()) for i in range(2)]
        moved, kept = sorted(flights, key=lambda f: -f.pair)
        run_dir = make_run_dir()
        ctx = zmq.asyncio.Context()
        new = [ipc_address(run_dir, name) for name in ("new-prefill", "new-decode")]
        prefill = AsyncInbox(new[0], ctx)
        try:
            core.on_message(PairMoved(1, *new), "launcher")
            event = await moved.next_event()
            assert event.finish_reason == "error" and "host was replaced" in event.error
            assert kept.events.empty()
            report = core.health()
            assert report["pairs"][1]["state"] == "starting" and report["services"]["decode-1"]["pid"] is None
            core.release(kept, "stop")
            for name in ("prefill-1", "decode-1"):
                core.on_message(Ready(name, os.getpid() + 1, capacity=2))
            again = [await core.submit([7], SAMPLING, time.monotonic()) for _ in range(2)]
            assert sorted(f.pair for f in again) == [0, 1]
            generate = await asyncio.wait_for(prefill.recv(), 5)
            assert isinstance(generate, Generate) and generate.prompt_ids == [7]
        finally:
            prefill.close()
            ctx.destroy(linger=0)
            shutil.rmtree(run_dir, ignore_errors=True)

    run_core(test, pairs=2, max_running=0)
