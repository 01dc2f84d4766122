"""A real router (uvicorn in a thread, real ZeroMQ ipc sockets) and a protocol peer standing in for the
prefill and decode workers, which binds their inboxes and answers `Generate` with `Tokens` events.

The peer picks its behaviour from a tag in the prompt: `[slow]` streams until aborted, `[error]` fails at
once, `[error-second]` fails the second of a request's choices at once, `[error-mid]` fails after a few
tokens, `[abort]` is aborted by the worker, `[shuffle]` sends decode's events before prefill's first token;
`[tool]` gets `TOOL_REPLY`, which calls a function (`[tool-xml]`: `TOOL_REPLY_XML`, a call in Qwen3-Coder's
XML form; `[think]` `THINK_REPLY` and `[think-tool]` `THINK_TOOL_REPLY`, the end of a reasoning block the
prompt opened, then an answer or a call); anything else gets `REPLY` (tokens of the real
tokenizer) then EOS, with `peer_logprobs` when the request asks for log-probabilities (its prompt's
tokens' at positions 100 and on).
`[refused]` fails at once as the request's own fault (`Tokens.refused`, `REFUSAL`).
"""

from __future__ import annotations

import itertools
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn
import zmq

from common.ipc.transport import Inbox, Outbox, ipc_address, make_run_dir
from common.model.defaults import default_model_dir
from common.protocol import Abort, Generate, Heartbeat, Message, Ready, TokenLogprobs, Tokens
from common.text.tokenizer import Tokenizer
from services.router import RouterConfig, WorkerPair, create_app
from services.router.http import ErrorAnsweringH11
from tests.conftest import free_port

REPLY = "Hello from Spillway: café, 日本語 and 🙂 — done."
TOOL_REPLY = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
)
THINK_REPLY = "Two and two make four.\n</think>\n\nIt is 4."
THINK_TOOL_REPLY = (
    "A call, then.</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)
TOOL_REPLY_XML = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
EOS = 2
REFUSAL = "The structured output's grammar did not compile within 20 s (--grammar-timeout)."
"""What the peer fails a `[refused]` request with: the request's own fault (`Tokens.refused`)."""

Plan = Iterator[tuple[float, str, Tokens]]
"""(delay before sending, service that sends, event)."""


def peer_logprobs(position: int, token: int, top: int) -> TokenLogprobs:
    """The peer's log-probabilities of the generated token number `position` (`token`): -(position + 1) / 4,
    the token itself the best of `top` alternatives, then the ids after it, each 1 lower."""
    value = -(position + 1) / 4
    return TokenLogprobs(value, [token + i for i in range(top)], [value - i for i in range(top)])


class Peer:
    """Stands in for prefill and decode: binds their inboxes, pushes Ready/Heartbeat/Tokens to the router."""

    def __init__(self, run_dir: Path, tokenizer: Tokenizer, ready: bool = True) -> None:
        self.tok = tokenizer
        self.reply_ids = tokenizer.encode(REPLY)
        self.ctx = zmq.Context()
        self._addresses = {s: ipc_address(run_dir, s) for s in ("prefill", "decode")}
        self.inboxes = {s: Inbox(address, self.ctx) for s, address in self._addresses.items()}
        self._poller = zmq.Poller()
        self.router = Outbox(ipc_address(run_dir, "router"), self.ctx)
        self.received: list[tuple[str, Message]] = []
        self.heartbeating = {"prefill": ready, "decode": ready}
        self.pids = {"prefill": os.getpid(), "decode": os.getpid()}
        self.instances = {"prefill": "", "decode": ""}
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._plans: dict[str, tuple[float, Plan]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        for service in ("prefill", "decode"):
            if ready:
                self.router.send(Ready(service, os.getpid(), capacity=8))
        self._thread.start()

    # Test-thread API (sockets stay on the peer thread).

    def announce(
        self, service: str, pid: int | None = None, max_context: int = 0, instance: str | None = None
    ) -> None:
        """Send `Ready` for `service` (as process `pid` and start `instance`: a new one is a restart;
        holding `max_context` tokens, 0: no limit of its own) and keep heartbeating."""

        def command() -> None:
            self.pids[service] = pid or self.pids[service]
            self.instances[service] = self.instances[service] if instance is None else instance
            ready = Ready(service, self.pids[service], capacity=8, max_context=max_context,
                          instance=self.instances[service])  # fmt: skip
            self.router.send(ready)
            self.heartbeating[service] = True

        self._commands.put(command)

    def silence(self, service: str) -> None:
        self._commands.put(lambda: self.heartbeating.__setitem__(service, False))

    def emit(self, event: Tokens) -> None:
        """Send `event` to the router as a worker would."""
        self._commands.put(lambda: self.router.send(event))

    def exit(self, service: str) -> None:
        """As if `service`'s process died: its inbox closes, its heartbeats and events stop."""

        def command() -> None:
            self.heartbeating[service] = False
            self._plans.clear()
            inbox = self.inboxes.pop(service)
            self._poller.unregister(inbox.sock)
            inbox.close()

        self._commands.put(command)

    def restart(self, service: str, pid: int, instance: str) -> None:
        """`service`'s successor, process `pid` of start `instance`: binds the inbox again and announces
        itself."""

        def command() -> None:
            self.inboxes[service] = Inbox(self._addresses[service], self.ctx)
            self._poller.register(self.inboxes[service].sock, zmq.POLLIN)

        self._commands.put(command)
        self.announce(service, pid, instance=instance)

    def generates(self) -> list[Generate]:
        return [m for _, m in self.received if isinstance(m, Generate)]

    def choices(self) -> list[tuple[str, int | None]]:
        """Every request the Generates named, their siblings after each: (id, seed)."""
        return [
            (rid, seed)
            for g in self.generates()
            for rid, seed in [(g.rid, g.sampling.seed), *((s.rid, s.seed) for s in g.siblings)]
        ]

    def aborted_by(self, rid: str) -> set[str]:
        return {s for s, m in self.received if isinstance(m, Abort) and m.rid == rid}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.ctx.destroy(linger=0)

    # Peer thread.

    def _run(self) -> None:
        for inbox in self.inboxes.values():
            self._poller.register(inbox.sock, zmq.POLLIN)
        next_beat = 0.0
        while not self._stop.is_set():
            while not self._commands.empty():
                self._commands.get()()
            for service, inbox in self.inboxes.items():
                for msg in inbox.drain():
                    self.received.append((service, msg))
                    self._on_message(msg)
            now = time.monotonic()
            if now >= next_beat:
                for service, on in self.heartbeating.items():
                    if on:
                        beat = Heartbeat(service, self.pids[service], instance=self.instances[service])
                        self.router.send(beat)
                next_beat = now + 0.1
            self._emit_due(now)
            self._poller.poll(2)

    def _on_message(self, msg: Message) -> None:
        if isinstance(msg, Generate):  # and each of its siblings: the same plan, under its own id
            for rid in [msg.rid, *(s.rid for s in msg.siblings)]:
                self._plans[rid] = (time.monotonic(), self._plan(msg, rid))
        elif isinstance(msg, Abort):
            self._plans.pop(msg.rid, None)

    def _emit_due(self, now: float) -> None:
        for rid, (due, plan) in list(self._plans.items()):
            while due <= now:
                try:
                    delay, _service, event = next(plan)
                except StopIteration:
                    self._plans.pop(rid, None)
                    break
                self.router.send(event)
                due = now + delay
                self._plans[rid] = (due, plan)

    def _plan(self, gen: Generate, rid: str) -> Plan:
        prompt = self.tok.decode(gen.prompt_ids)
        n_prompt, limit = len(gen.prompt_ids), gen.sampling.max_tokens
        if "[error]" in prompt or ("[error-second]" in prompt and rid.endswith("-1")):
            return iter([(0.0, "prefill", Tokens(rid, [], "error", error="out of KV pages"))])
        if "[refused]" in prompt:
            return iter([(0.0, "prefill", Tokens(rid, [], "error", error=REFUSAL, refused=True))])
        if "[slow]" in prompt:
            return self._slow(rid, n_prompt, limit)
        scripted = {"[tool-xml]": TOOL_REPLY_XML, "[tool]": TOOL_REPLY, "[think-tool]": THINK_TOOL_REPLY}
        scripted["[think]"] = THINK_REPLY
        text = next((reply for mark, reply in scripted.items() if mark in prompt), None)
        reply = self.reply_ids if text is None else self.tok.encode(text)
        ids = [*reply, EOS][:limit]
        finish = "stop" if len(ids) == len(reply) + 1 else "length"
        top, echo = gen.sampling.logprobs, gen.sampling.prompt_logprobs
        rows = [] if top is None else [peer_logprobs(i, t, top) for i, t in enumerate(ids)]
        scored = (
            []
            if echo is None
            else [peer_logprobs(100 + i, t, echo) for i, t in enumerate(gen.prompt_ids[1:])]
        )
        first = Tokens(
            rid, ids[:1], finish if len(ids) == 1 else None, prompt_tokens=n_prompt, logprobs=rows[:1],
            prompt_logprobs=scored,
        )  # fmt: skip
        rest = []
        for i in range(1, len(ids), 3):  # decode sends 3 tokens per event
            last = i + 3 >= len(ids)
            rest.append(
                Tokens(rid, ids[i : i + 3], finish if last else None, index=i, logprobs=rows[i : i + 3])
            )
        if "[error-mid]" in prompt:
            rest = [*rest[:1], Tokens(rid, [], "error", error="decode crashed", index=4)]
        if "[abort]" in prompt:
            rest = [Tokens(rid, [], "abort", index=1)]
        if "[shuffle]" in prompt:
            return iter([(0.0, "decode", t) for t in reversed(rest)] + [(0.0, "prefill", first)])
        return iter([(0.0, "prefill", first)] + [(0.002, "decode", t) for t in rest])

    def _slow(self, rid: str, n_prompt: int, limit: int) -> Plan:
        for i, token in zip(range(limit), itertools.cycle(self.reply_ids), strict=False):
            finish = "length" if i + 1 == limit else None
            yield 0.02, "decode", Tokens(rid, [token], finish, prompt_tokens=n_prompt, index=i)


@dataclass
class Served:
    url: str
    peer: Peer
    config: RouterConfig
    app: Any


@contextmanager
def serve_router(peer_ready: bool = True, **overrides: Any) -> Iterator[Served]:
    """A router on a free port with a fresh run dir and peer; stopped (and checked for leaks) on exit."""
    run_dir = make_run_dir()
    tokenizer = Tokenizer.from_dir(default_model_dir())
    peer = Peer(run_dir, tokenizer, ready=peer_ready)
    fields: dict[str, Any] = dict(
        model_dir=default_model_dir(),
        served_model_name="tiny",
        inbox=ipc_address(run_dir, "router"),
        pairs=[WorkerPair(ipc_address(run_dir, "prefill"), ipc_address(run_dir, "decode"))],
        port=free_port(),
        max_running=8,
        max_context=512,
    )
    config = RouterConfig(**{**fields, **overrides})
    app = create_app(config)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=config.port, log_level="warning", http=ErrorAnsweringH11)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    url = f"http://127.0.0.1:{config.port}"
    if peer_ready:
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 200)
    try:
        yield Served(url, peer, config, app)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        peer.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def streamed_calls(chunks: list[Any]) -> list[SimpleNamespace]:
    """The function calls a stream's chunks (the openai client's) write, assembled from their pieces: each
    call's first piece names it (id, name), the rest add to its arguments; in the order they are numbered."""
    calls: list[SimpleNamespace] = []
    for chunk in chunks:
        for piece in chunk.choices[0].delta.tool_calls or []:
            if piece.id is not None:
                assert piece.index == len(calls) and piece.function.name
                calls.append(
                    SimpleNamespace(id=piece.id, index=piece.index, name=piece.function.name, arguments="")
                )
            else:
                assert piece.function.name is None and piece.index == len(calls) - 1
            calls[piece.index].arguments += piece.function.arguments or ""
    return calls


def wait_until(predicate: Callable[[], Any], timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)
    return result


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve_router() as s:
        yield s


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir())


@pytest.fixture(name="serve_router")
def serve_router_fixture() -> Callable[..., Any]:
    """`with serve_router(**RouterConfig overrides) as served:` a router of its own (special configs)."""
    return serve_router


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., Any]:
    return wait_until


@pytest.fixture
def reply() -> str:
    return REPLY


@pytest.fixture
def make_peer() -> Iterator[Callable[..., Peer]]:
    """`make_peer(run_dir, ready=True)`: a peer of its own, closed after the test."""
    peers: list[Peer] = []

    def make(run_dir: Path, ready: bool = True) -> Peer:
        peers.append(Peer(run_dir, Tokenizer.from_dir(default_model_dir()), ready=ready))
        return peers[-1]

    yield make
    for peer in peers:
        peer.close()


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A private run directory for ipc:// sockets, removed after the test."""
    path = make_run_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(name="free_port")
def free_port_fixture() -> Callable[[], int]:
    return free_port
