"""Prefill and decode cores stepped in one process, their messages passed through the wire encoding and the
state shared through exported shared memory: the tokens equal the offline engine's; aborts free everything."""

from __future__ import annotations

import msgspec
import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.defaults import default_model_dir
from common.model.synthetic.checkpoint import make_model
from common.protocol import (
    AllocState,
    Generate,
    PrefillDone,
    ReleaseState,
    SamplingParams,
    Sibling,
    Tokens,
    decode,
    encode,
)
from common.workers.decode import DecodeCore
from common.workers.prefill import PrefillCore
from common.workers.sharing import decode_exports, host_allocator, prefill_model, shared_allocator
from tests.common.workers.pair import deliver

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42], [100] * 13]


@pytest.fixture(
    scope="module",
    params=[
        ("qwen3_moe", None, "float32"),
        ("qwen3_moe", "0.25", "float32"),
        ("qwen3_moe", "0.25", "bfloat16"),  # float32 buffers (RoPE) in a bf16 model
        ("qwen4_exp", None, "float32"),
        ("qwen4_exp", "0.25", "bfloat16"),
        ("qwen4_exp", "0.25", "fp8-kv"),  # fp8 K/V pages: prefill quantizes with decode's scales
        ("qwen4_exp", "0.25", "host-embeddings"),  # prefill attaches decode's host embedding rows
        ("qwen4_exp", "0.25", "fp8-resident"),  # prefill maps decode's fp8 projections
        ("qwen3_moe", "0.25", "lend-kv"),  # idle KV pages lent to the cache; prefill maps both aliased
        ("qwen4_exp", "0.25", "lend-arena"),  # prefill's arena in decode's pool, lent between prefills
    ],
    ids=[
        "qwen3-resident",
        "qwen3-offloaded",
        "qwen3-offloaded-bf16",
        "qwen4-resident",
        "qwen4-offloaded-bf16",
        "qwen4-offloaded-fp8kv",
        "qwen4-offloaded-host-embeddings",
        "qwen4-offloaded-fp8-resident",
        "qwen3-offloaded-lend-kv",
        "qwen4-offloaded-lend-arena",
    ],
)
def cores(request, tmp_path_factory):
    arch, cache, dtype = request.param
    kv_dtype = "fp8_e4m3" if dtype == "fp8-kv" else None
    on_host = dtype == "host-embeddings"
    resident = "fp8" if dtype == "fp8-resident" else None
    lend_kv, lend_arena = dtype == "lend-kv", dtype == "lend-arena"
    dtype = "float32" if kv_dtype or on_host or resident or lend_kv or lend_arena else dtype
    if arch == "qwen3_moe":
        model_dir = default_model_dir()
    else:
        model_dir = make_model(tmp_path_factory.mktemp(arch), preset="tiny", arch=arch)
    cfg = WorkerConfig(
        model_dir=str(model_dir),
        max_running=2,
        max_context=256,
        prefill_chunk=5,
        layer_major_tokens=12,  # the 13-token prompt: a layer-major pass of 5 + 5 + 2 tokens, then one of 1
        expert_cache=cache,
        dtype=dtype,
        kv_dtype=kv_dtype,
        embeddings_on_host=on_host,
        resident_dtype=resident,
        lend_kv=lend_kv,
        lend_arena=lend_arena,
    )
    dec = DecodeCore(cfg, shared_allocator, host_allocator)
    exports = decode(encode(decode_exports(dec)))
    model, pools, eos = prefill_model(cfg, exports)
    return cfg, dec, PrefillCore(cfg, model, pools, eos)


def _deliver(dec: DecodeCore, pre: PrefillCore, box, seen: dict[str, list[Tokens]]):
    return deliver(dec, pre, box, lambda event: seen.setdefault(event.rid, []).append(event))


def _run(dec: DecodeCore, pre: PrefillCore, box, abort_after: dict[str, int] | None = None):
    seen: dict[str, list[Tokens]] = {}
    for _ in range(1000):
        box = _deliver(dec, pre, box, seen) + pre.step()
        for event in dec.step():
            seen.setdefault(event.rid, []).append(event)
            if event.finish_reason:
                box += [("prefill", g) for g in dec.grant_pending()]
        for rid, n in (abort_after or {}).items():
            if sum(len(e.token_ids) for e in seen.get(rid, [])) >= n:
                box += [("prefill", g) for g in dec.abort(rid)]
                box += pre.abort(rid) + [("prefill", g) for g in dec.grant_pending()]
        if (
            not box
            and not dec.busy
            and not dec.running
            and not pre.busy
            and not pre.compiling
            and not pre.queue
            and pre.asked is None
        ):
            return seen
    raise AssertionError("did not finish")


def test_disaggregated_tokens_equal_offline_engine(cores):
    cfg, dec, pre = cores
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    box = [out for i, p in enumerate(PROMPTS) for out in pre.submit(Generate(f"r{i}", p, greedy, 0.0))]
    seen = _run(dec, pre, box)
    engine = Engine(cfg)  # the single-process path, same config
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    reference = [r.token_ids for r in engine.generate(PROMPTS, params)]
    for i, ref in enumerate(reference):
        events = seen[f"r{i}"]
        assert [e.index for e in events] == list(range(10))
        assert [t for e in events for t in e.token_ids] == ref
        assert events[0].prompt_tokens == len(PROMPTS[i]) and events[-1].finish_reason == "length"
    assert dec.pool.pages.num_free == dec.pool.num_pages and dec.pool.slots.num_free == cfg.max_running
    if cfg.expert_cache:  # prefill read decode's store and its cache (frozen meanwhile), now thawed
        assert pre.runner.model.experts.shared_cache is not None
        assert not dec.engine.offload.tables.frozen
        dec.engine.offload.tables.check()


def test_sampled_and_stopped_requests_equal_offline_engine(cores):
    """Seeded sampling (a step launched before the last token reached the host counts it in the sampling
    step) and a stop token met while the request's next step is already launched: the engine's tokens,
    nothing after the stop, every page and slot back."""
    cfg, dec, pre = cores
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=9, ignore_eos=True, seed=7 + i)
        for i in range(3)
    ]
    reference = [r.token_ids for r in Engine(cfg).generate(PROMPTS, params)]
    stop = reference[0][4]
    params[0] = msgspec.structs.replace(params[0], stop_token_ids=(stop,))
    box = [out for i, p in enumerate(PROMPTS) for out in pre.submit(Generate(f"s{i}", p, params[i], 0.0))]
    seen = _run(dec, pre, box)
    tokens = {rid: [t for e in events for t in e.token_ids] for rid, events in seen.items()}
    assert (
        tokens["s0"] == reference[0][: reference[0].index(stop) + 1]
        and seen["s0"][-1].finish_reason == "stop"
    )
    assert tokens["s1"] == reference[1] and tokens["s2"] == reference[2]
    assert dec.pool.pages.num_free == dec.pool.num_pages and dec.pool.slots.num_free == cfg.max_running


def test_logprobs_come_with_the_tokens_of_the_requests_that_ask(cores):
    """Prefill's first token and decode's pipelined ones carry log-probabilities when their request asked
    (each with its own number of alternatives, in one batch), and the tokens are those asked without."""
    cfg, dec, pre = cores
    if not cfg.lend_arena:
        pytest.skip("one case is enough: the path is the same for every config")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    asks = [None, 0, 3]
    box = [
        out
        for i, (p, k) in enumerate(zip(PROMPTS, asks, strict=True))
        for out in pre.submit(Generate(f"l{i}", p, msgspec.structs.replace(greedy, logprobs=k), 0.0))
    ]
    seen = _run(dec, pre, box)
    reference = [r.token_ids for r in Engine(cfg).generate(PROMPTS, greedy)]
    for i, k in enumerate(asks):
        events = seen[f"l{i}"]
        assert [t for e in events for t in e.token_ids] == reference[i]
        rows = [row for e in events for row in e.logprobs]
        if k is None:
            assert rows == []
            continue
        assert len(rows) == 6 and all(len(r.top_ids) == len(r.top_logprobs) == k for r in rows)
        assert all(r.logprob <= 0 for r in rows)
        if k:  # greedy: the chosen token is the best alternative
            assert [r.top_ids[0] for r in rows] == reference[i]
            assert all(r.logprob == r.top_logprobs[0] for r in rows)


def test_penalized_biased_and_held_requests_equal_offline_engine(cores):
    """Repetition (over the prompt, which decode gets in PrefillDone), frequency and presence penalties
    counted on decode's device row while its steps run ahead of the host, a logit bias, min_tokens: the
    tokens the offline engine samples (one step at a time) for the same requests."""
    cfg, dec, pre = cores
    if cfg.expert_cache or cfg.dtype != "float32":
        pytest.skip("one resident case an architecture is enough: the path is the same")
    base = SamplingParams(temperature=0.0, max_tokens=12)
    params = [
        msgspec.structs.replace(base, repetition_penalty=1.8, frequency_penalty=0.5),
        msgspec.structs.replace(base, temperature=0.9, seed=4, presence_penalty=1.5, min_p=0.02),
        msgspec.structs.replace(base, min_tokens=12, logit_bias=((7, 4.0),)),
    ]
    reference = Engine(cfg).generate(PROMPTS, params)
    box = [out for i, p in enumerate(PROMPTS) for out in pre.submit(Generate(f"p{i}", p, params[i], 0.0))]
    seen = _run(dec, pre, box)
    for i, ref in enumerate(reference):
        assert [t for e in seen[f"p{i}"] for t in e.token_ids] == ref.token_ids
    plain = Engine(cfg).generate(PROMPTS[:1], base)[0].token_ids
    assert plain != reference[0].token_ids, "the penalties changed what greedy decoding picks"
    assert dec.pool.pages.num_free == dec.pool.num_pages


def test_prompt_logprobs_span_the_chunks(cores):
    """A prompt's log-probabilities (an echo's), made chunk by chunk (5 tokens a chunk here): each token's
    after the ones before it, what one pass over the whole prompt gives."""
    cfg, dec, pre = cores
    if cfg.expert_cache or cfg.dtype != "float32":
        pytest.skip("one resident case an architecture is enough: the path is the same")
    prompt = PROMPTS[2] + PROMPTS[0]  # 21 tokens: chunks of 5, 5, 5, 5, 1
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    seen = _run(dec, pre, pre.submit(Generate("e", prompt, params, 0.0)))
    rows = seen["e"][0].prompt_logprobs
    engine = Engine(cfg)
    seq = engine.runner.new_sequence()
    want = torch.log_softmax(
        engine.runner.forward([seq], [prompt], all_logits=True).float(), dim=-1
    )  # [T, V]
    assert len(rows) == len(prompt) - 1
    got = torch.tensor([r.logprob for r in rows])
    torch.testing.assert_close(
        got, want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])], atol=1e-4, rtol=0
    )
    best, best_ids = want[:-1].topk(3, dim=-1)
    assert [r.top_ids for r in rows] == best_ids.tolist()
    torch.testing.assert_close(torch.tensor([r.top_logprobs for r in rows]), best, atol=1e-4, rtol=0)
    assert all(e.prompt_logprobs == [] for e in seen["e"][1:])


def test_structured_requests_equal_offline_engine(cores):
    """A request under a JSON schema's grammar takes no step ahead of the host (its matcher reads each
    token before the next is masked) while the one beside it runs ahead: both get the engine's tokens, and
    the structured text is the schema's."""
    import json

    from common.sampling.structured import structure_of

    cfg, dec, pre = cores
    if cfg.expert_cache or cfg.dtype != "float32":
        pytest.skip("one resident case an architecture is enough: the path is the same")
    schema = {"type": "object", "properties": {"pick": {"enum": ["a", "b", "c"]}}, "required": ["pick"]}
    structure = structure_of({"type": "json_schema", "json_schema": {"schema": schema}})
    params = [
        SamplingParams(temperature=0.9, seed=2, max_tokens=30, structure=structure),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    ]
    engine = Engine(cfg)
    reference = engine.generate(PROMPTS[:2], params)
    box = [out for i, p in enumerate(PROMPTS[:2]) for out in pre.submit(Generate(f"j{i}", p, params[i], 0.0))]
    seen = _run(dec, pre, box)
    for i, ref in enumerate(reference):
        assert [t for e in seen[f"j{i}"] for t in e.token_ids] == ref.token_ids
    assert json.loads(engine.tokenizer.decode(reference[0].token_ids))["pick"] in "abc"
    assert reference[0].finish_reason == "stop"


def test_decode_steps_while_a_grammar_compiles(cores):
    """A structured request's grammar compiles on the grammars' thread: while it does, the request waits
    unadmitted and the lane beside it keeps taking steps; once it has compiled, both get the engine's
    tokens."""
    import threading

    from common.sampling.structured import structure_of

    cfg, dec, pre = cores
    if cfg.expert_cache or cfg.dtype != "float32":
        pytest.skip("one resident case an architecture is enough: the path is the same")
    schema = {"type": "object", "properties": {"held": {"enum": ["x", "y"]}}, "required": ["held"]}
    structure = structure_of({"type": "json_schema", "json_schema": {"schema": schema}})
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=4, max_tokens=30, structure=structure),
    ]
    gate = threading.Event()
    dec.processors._grammar_set()._thread.submit(gate.wait, 30)  # decode's compiles queue behind this
    box = [out for i, p in enumerate(PROMPTS[:2]) for out in pre.submit(Generate(f"g{i}", p, params[i], 0.0))]
    seen: dict[str, list[Tokens]] = {}
    try:
        for _ in range(200):
            box = _deliver(dec, pre, box, seen) + pre.step()
            for event in dec.step():
                seen.setdefault(event.rid, []).append(event)
            waited = "g1" in dec.admitting and len(seen["g0"]) >= 8
            if waited:
                break
        assert waited, "the plain lane took no steps while the grammar compiled"
        assert [len(e.token_ids) for e in seen["g1"]] == [1]  # prefill's first token only
    finally:
        gate.set()
    for rid, events in _run(dec, pre, box).items():
        seen.setdefault(rid, []).extend(events)
    reference = Engine(cfg).generate(PROMPTS[:2], params)
    for i, ref in enumerate(reference):
        assert [t for e in seen[f"g{i}"] for t in e.token_ids] == ref.token_ids
    assert not dec.admitting and dec.pool.slots.num_free == cfg.max_running


def test_siblings_share_one_prefill_and_sample_their_own(cores, monkeypatch):
    """A prompt with a sibling is prefilled once: each samples its first token at its own seed, decode copies
    the prompt's state to the sibling, and each decodes what the engine gives at its seed alone."""
    cfg, dec, pre = cores
    if cfg.dtype != "float32" or cfg.lend_kv:
        pytest.skip("the copy is the same for every dtype")
    done: list[PrefillDone] = []
    start = dec.prefill_done
    monkeypatch.setattr(dec, "prefill_done", lambda msg: (done.append(msg), start(msg)))
    sampling = SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)
    gen = Generate("s", PROMPTS[2], sampling, 0.0, siblings=[Sibling("s-1", 8)])
    seen = _run(dec, pre, pre.submit(gen))
    assert [(m.rid, [s.rid for s in m.siblings]) for m in done] == [("s", ["s-1"])]
    engine = Engine(cfg)
    for rid, seed in [("s", 7), ("s-1", 8)]:
        params = msgspec.structs.replace(sampling, seed=seed)
        (ref,) = engine.generate([PROMPTS[2]], params)
        assert [t for e in seen[rid] for t in e.token_ids] == ref.token_ids
        assert seen[rid][0].prompt_tokens == len(PROMPTS[2])
    assert [e.token_ids for e in seen["s"]] != [e.token_ids for e in seen["s-1"]]  # their own samples
    assert dec.pool.pages.num_free == dec.pool.num_pages and dec.pool.slots.num_free == cfg.max_running


def test_siblings_outlive_an_aborted_source_and_an_aborted_sibling_frees_its_lane(cores, monkeypatch):
    """Decode aborts the prompt's own request while prefill holds it: its sibling still starts from a copy.
    A sibling aborted before its prompt is done samples nothing and its reserved lane is freed at once; one
    whose prompt's request prefill aborts ends with an error, and so do both where decode cannot copy the
    state. More siblings than lanes are refused."""
    cfg, dec, pre = cores
    if cfg.dtype != "float32" or cfg.expert_cache:
        pytest.skip("decode's bookkeeping: one model is enough")
    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    box = pre.submit(Generate("a", PROMPTS[0], sampling, 0.0, siblings=[Sibling("a-1", None)]))
    box = _deliver(dec, pre, box, {})  # AllocState → grant: "a" granted, "a-1" reserved
    assert "a" in dec.granted and "a-1" in dec.reserved
    dec.abort("a")  # the router's abort reaches decode first
    seen = _run(dec, pre, box)
    assert [len(e.token_ids) for e in seen["a"]] == [1]  # prefill's first token only
    (ref,) = Engine(cfg).generate([PROMPTS[0]], sampling)
    assert [t for e in seen["a-1"] for t in e.token_ids] == ref.token_ids

    box = pre.submit(Generate("b", PROMPTS[1], sampling, 0.0, siblings=[Sibling("b-1", 3)]))
    box = _deliver(dec, pre, box, {})
    box += pre.abort("b-1") + [("prefill", g) for g in dec.abort("b-1")]
    assert "b-1" not in dec.reserved
    seen = _run(dec, pre, box)
    assert "b-1" not in seen and seen["b"][-1].finish_reason == "length"
    assert dec.pool.pages.num_free == dec.pool.num_pages and dec.pool.slots.num_free == cfg.max_running

    box = pre.submit(Generate("d", PROMPTS[2], sampling, 0.0, siblings=[Sibling("d-1", None)]))
    box = _deliver(dec, pre, box, {}) + pre.step()  # granted; prefill's first pass
    out = pre.abort("d")  # the prompt's request aborted at prefill: its sibling ends too, never hangs
    assert [(m.rid, m.finish_reason) for dest, m in out if dest == "router"] == [("d-1", "error")]
    _run(dec, pre, box + out)  # its ReleaseState frees the sibling's reserved state with its own
    assert not dec.reserved and dec.pool.slots.num_free == cfg.max_running

    def fail(src, dst) -> None:
        raise torch.OutOfMemoryError("no room for the copy's temporaries")

    monkeypatch.setattr(dec.pool, "copy", fail)  # decode cannot copy: both choices end with an error
    seen = _run(dec, pre, pre.submit(Generate("e", PROMPTS[1], sampling, 0.0, siblings=[Sibling("e-1", 2)])))
    assert [seen[rid][-1].finish_reason for rid in ("e", "e-1")] == ["error", "error"]
    monkeypatch.undo()
    assert not dec.reserved and not dec.granted and not pre.cut
    assert dec.pool.pages.num_free == dec.pool.num_pages and dec.pool.slots.num_free == cfg.max_running

    many = [Sibling(f"c-{i}", i) for i in range(1, cfg.max_running + 1)]
    seen = _run(dec, pre, pre.submit(Generate("c", PROMPTS[1], sampling, 0.0, siblings=many)))
    assert seen["c"][0].finish_reason == "error" and "need as many lanes" in seen["c"][0].error
    assert all(seen[s.rid][0].finish_reason == "error" for s in many)


def test_aborts_free_every_page_and_slot(cores):
    cfg, dec, pre = cores
    sampling = SamplingParams(temperature=0.8, max_tokens=50, ignore_eos=True, seed=3)
    box = [out for i, p in enumerate(PROMPTS) for out in pre.submit(Generate(f"a{i}", p, sampling, 0.0))]
    box += pre.abort("a2")  # still queued
    seen = _run(dec, pre, box, abort_after={"a0": 3, "a1": 1})
    assert "a2" not in seen
    assert sum(len(e.token_ids) for e in seen["a0"]) < 50
    assert dec.pool.pages.num_free == dec.pool.num_pages and dec.pool.slots.num_free == cfg.max_running
    assert not dec.running and not dec.granted and not dec.freezes


def test_a_granted_state_freezes_the_cache_until_prefill_is_done(cores):
    cfg, dec, pre = cores
    if not cfg.expert_cache:
        pytest.skip("no expert cache")
    box = pre.submit(Generate("f", [3] * 12, SamplingParams(temperature=0.0, max_tokens=2), 0.0))
    box = _deliver(dec, pre, box, {})  # AllocState → grant
    assert dec.engine.offload.tables.frozen and "f" in dec.freezes
    _run(dec, pre, box)
    assert not dec.engine.offload.tables.frozen and not dec.freezes


@pytest.mark.parametrize("length", [300, 256])
def test_prompt_that_leaves_no_room_is_an_error_event(cores, length):
    """Longer than the context (256), or as long: no room for the token a request must generate."""
    _, dec, pre = cores
    box = pre.submit(Generate("long", [7] * length, SamplingParams(), 0.0))
    seen = _run(dec, pre, box)
    (event,) = seen["long"]
    assert event.finish_reason == "error" and str(length) in event.error
    assert dec.pool.pages.num_free == dec.pool.num_pages


def _clean(cfg: WorkerConfig, dec: DecodeCore, pre: PrefillCore) -> bool:
    """Nothing held by either core: every page and slot free, no freeze, no ask remembered."""
    return (
        dec.pool.pages.num_free == dec.pool.num_pages
        and dec.pool.slots.num_free == cfg.max_running
        and not (dec.running or dec.granted or dec.pending or dec.freezes or dec.aborted)
        and not (pre.queue or pre.asked or pre.job or pre.dropped)
    )


def test_a_second_generate_with_the_same_id_takes_nothing(cores):
    """Ids are the router's and unique: a resent Generate, or an ask for an id that holds state, is refused
    (a second lane for one id lost the first's state for good, then exhausted the slots)."""
    cfg, dec, pre = cores
    if not cfg.lend_arena:
        pytest.skip("one case is enough: the path is the same for every config")
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    box = pre.submit(Generate("twice", PROMPTS[0], sampling, 0.0))
    assert pre.submit(Generate("twice", PROMPTS[1], sampling, 0.0)) == []
    seen = _run(dec, pre, box)
    assert sum(len(e.token_ids) for e in seen["twice"]) == 4 and _clean(cfg, dec, pre)
    (grant,) = dec.alloc_state(AllocState("held", 5))
    (refusal,) = dec.alloc_state(AllocState("held", 5))
    assert grant.slot >= 0 and refusal.slot < 0 and "already" in refusal.error
    dec.release("held")
    assert _clean(cfg, dec, pre)


def test_an_abort_that_overtakes_the_ask_refuses_it(cores):
    """The router's Abort reaches decode before prefill's AllocState: the ask, when it comes, is refused
    (granted, the request ran unseen until max_tokens)."""
    cfg, dec, pre = cores
    if not cfg.lend_arena:
        pytest.skip("one case is enough: the path is the same for every config")
    assert dec.abort("early") == []
    box = pre.submit(Generate("early", PROMPTS[1], SamplingParams(max_tokens=40, ignore_eos=True), 0.0))
    seen = _run(dec, pre, box)
    (event,) = seen["early"]
    assert event.finish_reason == "error" and event.error == "aborted" and _clean(cfg, dec, pre)


def test_an_abort_of_a_waiting_ask_answers_it(cores):
    """Lanes full, prefill's ask waits at decode; both get the abort: decode refuses the waiting ask, so
    prefill forgets it (it waited for that answer for good)."""
    cfg, dec, pre = cores
    if not cfg.lend_arena:
        pytest.skip("one case is enough: the path is the same for every config")
    held = [dec.alloc_state(AllocState(f"lane{i}", 5))[0] for i in range(cfg.max_running)]
    (ask,) = pre.submit(Generate("wait", PROMPTS[1], SamplingParams(), 0.0))
    assert dec.alloc_state(decode(encode(ask[1]))) == [] and dec.pending
    box = pre.abort("wait")
    assert pre.dropped == {"wait"}
    (refusal,) = dec.abort("wait")
    assert pre.granted(decode(encode(refusal))) == [] and not pre.dropped
    for grant in held:
        dec.release(grant.rid)
    _run(dec, pre, box)
    assert _clean(cfg, dec, pre)


def test_decode_counts_the_prompts_routing_from_prefill(cores):
    """Prefill's own tables observe each prompt alone and PrefillDone carries what they counted; decode adds
    it to its cache's request statistics before the request's first step."""
    cfg, dec, pre = cores
    if not cfg.expert_cache:
        pytest.skip("no expert cache")
    tables = dec.engine.offload.tables
    box = pre.submit(Generate("s", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=3), 0.0))
    box = _deliver(dec, pre, box, {})  # AllocState → grant
    box = _deliver(dec, pre, box, {})  # the grant → the job
    before = tables.statistics().clone()
    while pre.busy:
        box += pre.step()
    (done,) = [decode(encode(m)) for dest, m in box if isinstance(m, PrefillDone)]
    sent = pre.tables.statistics()  # the prompt's 13 tokens counted as steps
    assert len(done.routing) == sent.numel() * 4 and float(sent[:, : tables.num_experts].sum()) > 0
    dec.prefill_done(done)
    torch.testing.assert_close(tables.statistics(), before + sent.to(before.device))
    _run(dec, pre, [(dest, m) for dest, m in box if not isinstance(m, PrefillDone)])


def test_an_abort_keeps_the_pages_prefill_may_be_writing(cores):
    """The router's abort reaches decode while prefill still writes the prompt's state: decode keeps the
    pages (and the freeze) until prefill gives them back, so they are neither granted again nor lent."""
    _, dec, pre = cores
    box = pre.submit(Generate("w", [9] * 12, SamplingParams(temperature=0.0, max_tokens=2), 0.0))
    box = _deliver(dec, pre, box, {})  # AllocState → grant
    box = _deliver(dec, pre, box, {})  # the grant → the job
    assert pre.busy
    held = list(dec.granted["w"].pages)
    dec.abort("w")
    assert dec.granted["w"].pages == held and dec.pool.pages.num_free == dec.pool.num_pages - len(held)
    assert "w" in dec.freezes
    _run(dec, pre, box + pre.abort("w"))  # prefill's Thaw and ReleaseState
    assert dec.pool.pages.num_free == dec.pool.num_pages and not dec.granted and not dec.aborted
    assert not dec.freezes


def test_a_lane_waits_for_lent_pages_while_prefill_reads_the_cache(cores):
    """KV lending: a running lane that needs a page past the limit while another prompt's prefill holds the
    cache frozen waits (no error, no token) until the thaw, then goes on; its tokens are the engine's."""
    cfg, dec, pre = cores
    if not cfg.lend_kv:
        pytest.skip("no KV lending")
    lending, greedy = dec.engine.kv_lending, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    prompt = [11 + i for i in range(20)]
    assert lending.limit == lending.stages[0] == 4  # 64 tokens: the lane needs more
    seen: dict[str, list[Tokens]] = {}
    box = pre.submit(Generate("grow", prompt, greedy, 0.0))
    while not dec.running:
        box = _deliver(dec, pre, box, seen) + pre.step()
    box += pre.submit(Generate("other", [5] * 6, SamplingParams(temperature=0.0, max_tokens=2), 0.0))
    box = _deliver(dec, pre, _deliver(dec, pre, box, seen), seen)  # granted, the job started: frozen
    assert dec.engine.offload.tables.frozen and pre.busy
    for _ in range(70):  # the lane runs into the limit and waits there
        for event in dec.step():
            seen.setdefault(event.rid, []).append(event)
    state = dec.running["grow"].state
    assert state.num_cached == len(state.pages) * cfg.page_size  # its pages full, the next one refused
    assert dec.stalled  # the worker's loop then waits for a message instead of spinning
    assert dec.pool.pages.high_water() <= lending.limit == lending.stages[0]
    tokens = [t for e in seen["grow"] for t in e.token_ids]
    assert len(tokens) < 60 and all(e.finish_reason is None for e in seen["grow"])
    rest = _run(dec, pre, box)
    tokens += [t for e in rest["grow"] for t in e.token_ids]
    (want,) = Engine(cfg).generate([prompt], greedy)
    assert tokens == want.token_ids and lending.limit == lending.stages[0]


def test_prefills_take_the_lent_arena_back(cores):
    """--lend-arena: prefill's arena is decode's bank (its rows in the pool prefill maps). The bank is lent
    only after a freeze of the running prefill ended, taken back (its slots evicted) when a prefill is granted
    its freeze, lent again at the thaw; a restarted prefill takes it back until its own first freeze ends.
    Tokens stay the engine's (test_disaggregated_tokens_equal_offline_engine runs with it too)."""
    cfg, dec, pre = cores
    if not cfg.lend_arena:
        pytest.skip("no arena lending")
    tables, e = dec.engine.offload.tables, dec.engine.config.num_experts
    arena = pre.runner.model.experts.arena
    assert tables.bank.numel() == 1 + 2 * e and arena.bases == [int(tables.bank[1]), int(tables.bank[1 + e])]
    pools = pre.runner.model.experts.pool, dec.engine.offload.pool  # prefill's is decode's, mapped
    assert all(pools[0][name].shape == t.shape for name, t in pools[1].items())
    dec.prefill_restarted()  # as a prefill worker's start
    assert tables.lent == 0 and not dec.bank_ready
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    box = pre.submit(Generate("b0", PROMPTS[0], greedy, 0.0))
    box = _deliver(dec, pre, box, {})  # AllocState → grant: the freeze begins, the bank is not lent
    assert tables.frozen and tables.lent == 0 and dec.bank_ready
    seen = _run(dec, pre, box)  # the thaw lends it; decode's steps then cache experts there
    assert not tables.frozen and tables.lent == tables.bank.numel()
    assert bool((tables.owner[tables.bank] >= 0).any())  # lent slots in use
    box = pre.submit(Generate("b1", PROMPTS[2], greedy, 0.0))
    box = _deliver(dec, pre, box, {})
    assert tables.frozen and tables.lent == 0 and bool((tables.owner[tables.bank] < 0).all())
    tables.check()
    seen |= _run(dec, pre, box)
    assert tables.lent == tables.bank.numel()
    tables.check()
    want = Engine(cfg).generate([PROMPTS[0], PROMPTS[2]], greedy)
    for rid, ref in zip(("b0", "b1"), want, strict=True):
        assert [t for ev in seen[rid] for t in ev.token_ids] == ref.token_ids
    dec.prefill_restarted()
    assert tables.lent == 0 and not dec.bank_ready


def test_a_prefill_that_fails_in_its_last_step_gives_everything_back(cores):
    """A failure while the first token is sampled leaves the job in place, so the worker's failure path
    (abort) sends the Thaw and the release: decode's freeze ends (and, with --lend-arena, the bank is lent
    again) instead of staying frozen for good."""
    cfg, dec, pre = cores
    if not cfg.lend_arena:
        pytest.skip("one case is enough: the path is the same for every config")
    box = pre.submit(Generate("x", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=2), 0.0))
    box = _deliver(dec, pre, _deliver(dec, pre, box, {}), {})  # granted, the job started
    assert "x" in dec.freezes and pre.busy

    def fail(job, logits):
        raise RuntimeError("sampling failed")

    pre._finish = fail
    try:
        with pytest.raises(RuntimeError, match="sampling failed"):
            while True:
                pre.step()
    finally:
        del pre._finish
    assert pre.busy and pre.job.gen.rid == "x"
    _run(dec, pre, pre.abort("x"))
    assert not dec.freezes and not dec.granted and dec.engine.offload.tables.lent > 0


def test_a_grant_this_prefill_did_not_ask_for_is_given_back(cores):
    """After a decode restart, the new decode may grant what the previous prefill core asked for: the core
    gives it back, so the freeze that came with the grant ends (and, with --lend-arena, the bank is lent)."""
    cfg, dec, pre = cores
    if not cfg.lend_arena:
        pytest.skip("one case is enough: the path is the same for every config")
    (grant,) = dec.alloc_state(AllocState("stale", 5))
    assert "stale" in dec.freezes
    out = pre.granted(decode(encode(grant)))
    assert [type(m) for _, m in out] == [ReleaseState]
    _run(dec, pre, out)
    assert not dec.freezes and not dec.granted and dec.pool.pages.num_free == dec.pool.num_pages
