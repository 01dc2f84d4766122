"""DecodeCore's pipelined steps on their own (no prefill worker: its messages are made here): events of a
step that a grant landed between two steps keep the worker busy until the next step hands them out."""

from __future__ import annotations

from common.config import WorkerConfig
from common.model.defaults import default_model_dir
from common.protocol import AllocState, PrefillDone, SamplingParams
from common.workers.decode import DecodeCore


def _start(core: DecodeCore, rid: str, max_tokens: int) -> None:
    """A 4-token prompt's state granted and reported written (its contents do not matter here)."""
    (grant,) = core.alloc_state(AllocState(rid, 4))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    core.prefill_done(PrefillDone(rid, 4, 4, 7, params, 0, 0.0, grant.slot, grant.pages))


def test_events_landed_by_a_grant_keep_the_worker_busy() -> None:
    cfg = WorkerConfig(model_dir=str(default_model_dir()), max_running=2, max_context=64, dtype="float32")
    core = DecodeCore(cfg)
    _start(core, "a", 4)
    _start(core, "b", 3)
    assert core.alloc_state(AllocState("c", 4)) == []  # no lane: c waits
    events = []
    while not any(e.finish_reason for e in events):
        events = core.step()
    assert [e.rid for e in events if e.finish_reason] == ["b"] and core.pipeline.launched  # a's last: ahead
    (grant,) = core.grant_pending()  # as the worker does after a finish: it lands a's last step first
    assert grant.rid == "c" and not core.pipeline.launched
    assert not core.running and core.landed and core.busy  # a finished: its event still to hand out
    (last,) = core.step()
    assert (last.rid, last.finish_reason, last.index) == ("a", "length", 3) and not core.busy


def test_a_failed_step_ends_every_request_and_frees_their_state() -> None:
    """After a failure with steps launched: an error event for each running request, the launched steps
    forgotten (once done), every page and lane free again."""
    cfg = WorkerConfig(model_dir=str(default_model_dir()), max_running=2, max_context=64, dtype="float32")
    core = DecodeCore(cfg)
    _start(core, "a", 9)
    _start(core, "b", 9)
    core.step()
    core.step()
    assert len(core.pipeline.launched) == 1 and len(core.running) == 2
    events = core.fail("decode failed: boom")
    errors = [e for e in events if e.finish_reason == "error"]
    assert sorted(e.rid for e in errors) == ["a", "b"] and all("boom" in e.error for e in errors)
    assert not core.pipeline.launched and not core.running and not core.retiring and not core.busy
    assert core.pool.pages.num_free == core.pool.num_pages and core.pool.slots.num_free == cfg.max_running
