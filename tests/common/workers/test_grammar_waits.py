"""Grammar compiles never block a worker's loop: prefill and decode cores stepped in one process (their
messages through the wire encoding, the state in shared memory) while a structured request's compile is
held on the grammars' thread. The other requests keep getting tokens; a compile past the time budget, or a
form over the size budget, fails only its own request (refused: the router's 400)."""

from __future__ import annotations

import json
import threading
import time

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.defaults import default_model_dir
from common.protocol import Generate, SamplingParams, Sibling, Tokens, decode, encode
from common.workers.decode import DecodeCore
from common.workers.prefill import PrefillCore
from common.workers.sharing import decode_exports, host_allocator, prefill_model, shared_allocator
from tests.common.workers.pair import deliver

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42]]
PLAIN = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SCHEMA = {"type": "object", "properties": {"pick": {"enum": ["a", "b", "c"]}}, "required": ["pick"]}


def _structured(schema: dict = SCHEMA) -> SamplingParams:
    from common.sampling.structured import structure_of

    structure = structure_of({"type": "json_schema", "json_schema": {"schema": schema}})
    return SamplingParams(temperature=0.9, seed=2, max_tokens=30, structure=structure)


def _cores(**budgets) -> tuple[WorkerConfig, DecodeCore, PrefillCore]:
    cfg = WorkerConfig(
        model_dir=str(default_model_dir()), max_running=3, max_context=256, prefill_chunk=5, **budgets
    )
    dec = DecodeCore(cfg, shared_allocator, host_allocator)
    model, pools, eos = prefill_model(cfg, decode(encode(decode_exports(dec))))
    return cfg, dec, PrefillCore(cfg, model, pools, eos)


class Pair:
    """Both cores stepped as their loops step them; the router's events collected by request."""

    def __init__(self, dec: DecodeCore, pre: PrefillCore) -> None:
        self.dec, self.pre = dec, pre
        self.box: list = []
        self.seen: dict[str, list[Tokens]] = {}

    def submit(self, rid: str, prompt: list[int], params: SamplingParams, siblings=()) -> None:
        self.box += self.pre.submit(Generate(rid, prompt, params, 0.0, siblings=list(siblings)))

    def turn(self) -> None:
        self.box = deliver(self.dec, self.pre, self.box, self._to_router) + self.pre.step()
        for event in self.dec.step():
            self._to_router(event)
            if event.finish_reason:
                self.box += [("prefill", g) for g in self.dec.grant_pending()]

    def _to_router(self, event: Tokens) -> None:
        self.seen.setdefault(event.rid, []).append(event)

    def tokens(self, rid: str) -> list[int]:
        return [t for e in self.seen.get(rid, []) for t in e.token_ids]

    def ended(self, rid: str) -> bool:
        return any(e.finish_reason for e in self.seen.get(rid, []))

    def until(self, done, timeout_s: float = 60.0) -> None:
        """Step until `done()` (a compile ends on its own time: the loop looks again, as a worker's does)."""
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, "the cores did not get there"
            self.turn()
            if self.pre.compiling or self.dec.compiling:
                time.sleep(0.005)

    def idle(self) -> bool:
        dec, pre = self.dec, self.pre
        return not (self.box or dec.busy or dec.running or dec.compiling or pre.busy or pre.compiling)


def _hold(grammars_of) -> threading.Event:
    """Hold the grammars' thread (compiles queue behind it) until the event is set: a compile that takes
    as long as the test wants."""
    gate = threading.Event()
    grammars_of.processors._grammar_set()._thread.submit(gate.wait, 60)
    return gate


def test_prefill_prefills_others_while_a_grammar_compiles():
    """A structured request waits for its compile in a queue of its own: a plain request that came after
    it is prefilled and decoded meanwhile; once compiled, the structured one gets the engine's tokens."""
    cfg, dec, pre = _cores()
    pair = Pair(dec, pre)
    gate = _hold(pre)
    try:
        pair.submit("s", PROMPTS[0], _structured())
        pair.submit("p", PROMPTS[1], PLAIN)
        pair.until(lambda: pair.ended("p"))
        assert "s" in pre.grammars and "s" not in pair.seen  # still compiling: no token, no state asked
        assert len(pair.tokens("p")) == PLAIN.max_tokens
    finally:
        gate.set()
    pair.until(pair.idle)
    engine = Engine(cfg)
    (reference,) = engine.generate([PROMPTS[0]], _structured())
    assert pair.tokens("s") == reference.token_ids
    assert json.loads(engine.tokenizer.decode(reference.token_ids))["pick"] in "abc"
    assert dec.pool.slots.num_free == cfg.max_running and dec.pool.pages.num_free == dec.pool.num_pages


def test_a_compile_over_the_time_budget_fails_only_its_request():
    """A compile still running at the time budget fails its request and its sibling (refused: a 400),
    while the plain request beside it runs to its end; nothing is held afterwards."""
    cfg, dec, pre = _cores(grammar_timeout_s=0.3)
    pair = Pair(dec, pre)
    gate = _hold(pre)
    try:
        pair.submit("s", PROMPTS[0], _structured(), [Sibling("s-1", 5)])
        pair.submit("p", PROMPTS[1], PLAIN)
        pair.until(lambda: pair.ended("p") and pair.ended("s") and pair.ended("s-1"))
    finally:
        gate.set()
    for rid in ("s", "s-1"):
        (event,) = pair.seen[rid]
        assert event.finish_reason == "error" and event.refused
        assert "did not compile within 0.3 s" in event.error
    assert len(pair.tokens("p")) == PLAIN.max_tokens and pair.seen["p"][-1].finish_reason == "length"
    pair.until(pair.idle)
    assert dec.pool.slots.num_free == cfg.max_running and dec.pool.pages.num_free == dec.pool.num_pages


def test_a_form_over_the_size_budget_fails_at_once_uncompiled():
    """A form over the size budget is refused as it comes, with no compile; the next request is served."""
    _, dec, pre = _cores(grammar_max_bytes=400)
    big = {"type": "object", "properties": {"pick": {"enum": [f"item{i}" for i in range(100)]}}}
    ((dest, event),) = pre.submit(Generate("big", PROMPTS[0], _structured(big), 0.0))
    assert dest == "router" and event.finish_reason == "error" and event.refused
    assert "over the 400 this server compiles (--grammar-max-bytes)" in event.error
    assert not pre.compiling and not pre.processors._grammar_set()._forms  # nothing compiles for it
    pair = Pair(dec, pre)
    pair.submit("p", PROMPTS[1], PLAIN)
    pair.until(pair.idle)
    assert len(pair.tokens("p")) == PLAIN.max_tokens


def test_decode_fails_a_compile_over_the_time_budget_and_steps_the_others():
    """Decode compiles a structured request's grammar again (its own matcher): held past the time budget,
    the request ends after its first token with a refused error, while the plain lane keeps stepping."""
    cfg, dec, pre = _cores(grammar_timeout_s=0.3)
    pair = Pair(dec, pre)
    long = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    gate = _hold(dec)
    try:
        pair.submit("p", PROMPTS[1], long)
        pair.submit("s", PROMPTS[0], _structured())
        pair.until(lambda: "s" in dec.admitting)
        before = len(pair.tokens("p"))
        pair.until(lambda: pair.ended("s"))
        assert len(pair.tokens("p")) > before  # stepped while decode waited for the grammar
    finally:
        gate.set()
    first, last = pair.seen["s"]
    assert len(first.token_ids) == 1 and last.finish_reason == "error" and last.refused
    assert "did not compile within 0.3 s" in last.error
    pair.until(pair.idle)
    assert len(pair.tokens("p")) == long.max_tokens
    assert dec.pool.slots.num_free == cfg.max_running and dec.pool.pages.num_free == dec.pool.num_pages
