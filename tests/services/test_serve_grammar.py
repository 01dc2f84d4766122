"""A costly structured output under `spillway serve` (router, prefill, decode as OS processes), through the
official `openai` client: a schema whose grammar compiles past the time budget, and one over the size
budget, each get a 400 while the streams beside them keep getting tokens (no worker's loop waits for a
compile; the router builds no grammar over the size budget)."""

from __future__ import annotations

import itertools
import json
import threading
import time

import openai
import pytest

pytestmark = pytest.mark.slow


class Stream:
    """A streamed completion read on a thread of its own, with the time each chunk came."""

    def __init__(self, client: openai.OpenAI, model: str, max_tokens: int) -> None:
        self.times: list[float] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        args = dict(
            model=model, prompt="go", max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True}
        )
        self._thread = threading.Thread(target=self._read, args=(client, args), daemon=True)
        self._thread.start()

    def _read(self, client: openai.OpenAI, args: dict) -> None:
        try:
            with client.completions.create(**args) as chunks:
                for _ in chunks:
                    self.times.append(time.monotonic())
                    if self.stop.is_set():
                        return
        except BaseException as exc:
            self.error = exc

    def end(self) -> None:
        self.stop.set()
        self._thread.join(timeout=60)

    def longest_gap(self, since: float) -> float:
        """The longest wait between two chunks after `since` (time.monotonic())."""
        times = [t for t in self.times if t >= since]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def enum_format(items: int) -> dict:
    pick = {"enum": [f"item{i:06d}" for i in range(items)]}
    schema = {"type": "object", "properties": {"pick": pick}, "required": ["pick"]}
    return {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}


def test_costly_grammars_are_400s_and_the_other_streams_go_on(start_server) -> None:
    """Two streams run while a 100,000-item enum (past the 1 s time budget) and a 400,000-item one (over the
    size budget) are asked for: both are 400s, the streams never wait long; a small schema asked next is
    served at once, not behind the compile given up on (which runs on)."""
    server = start_server(
        "--threads", "1", "--max-context", "1024", "--grammar-timeout", "1", "--grammar-max-bytes", "2MiB"
    )
    client = server.client()
    model = client.models.list().data[0].id
    streams = [Stream(client, model, 900) for _ in range(2)]
    try:
        deadline = time.monotonic() + 60
        while not all(len(s.times) >= 3 for s in streams):
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.05)
        since = time.monotonic()
        ask = dict(model=model, messages=[{"role": "user", "content": "Pick one."}], max_tokens=20)
        with pytest.raises(openai.BadRequestError, match="did not compile within 1 s"):
            client.chat.completions.create(**ask, response_format=enum_format(100_000))  # type: ignore[call-overload]
        with pytest.raises(openai.BadRequestError, match="--grammar-max-bytes"):
            client.chat.completions.create(**ask, response_format=enum_format(400_000))  # type: ignore[call-overload]
        answered = time.monotonic()
        time.sleep(1.0)  # (the streams go on while the refused compile still runs on prefill's thread)
        assert all(s.error is None and s.times[-1] > answered for s in streams)
        gaps = [s.longest_gap(since) for s in streams]
        assert max(gaps) < 3.0, gaps  # (a compile in a worker's loop held them for its whole length)
        small = client.chat.completions.create(**{**ask, "max_tokens": 80}, response_format=enum_format(3))  # type: ignore[call-overload]
        picked = json.loads(small.choices[0].message.content or "")["pick"]
        assert picked in enum_format(3)["json_schema"]["schema"]["properties"]["pick"]["enum"]
    finally:
        for s in streams:
            s.end()
