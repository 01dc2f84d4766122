"""`spillway serve --device cuda`: decode owns the weights and state pools on the GPU, prefill maps them
through CUDA IPC (or, lending KV pages, the driver's shareable handles) and writes each prompt's state in
place; outputs equal the offline engine's on the GPU."""

from __future__ import annotations

import re

import pytest

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.defaults import default_model_dir
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--expert-cache", "0.25"],
        ["--expert-cache", "0.25", "--lend-kv"],
        ["--expert-cache", "0.25", "--lend-arena"],
    ],
    ids=["resident", "offloaded", "lend-kv", "lend-arena"],
)
def test_serving_on_cuda_equals_offline_engine(tmp_path, start_server, extra):
    """With --lend-kv decode's KV pool and expert pool are driver mappings (a 2 MiB chunk is 512 of this
    model's pages: its 1,024 pages lend their upper half), which prefill imports through the fd server. With
    --lend-arena prefill copies its experts into decode's pool (CUDA IPC), in rows decode's cache holds
    between prefills (after the first: prefill's warm-up writes them)."""
    model = make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe")
    server = start_server(  # float32, as the engine it is compared with (serve's auto: bfloat16 on CUDA)
        "--model", str(model), "--device", "cuda", "--dtype", "float32", "--max-running", "4", *extra
    )
    client = server.client()
    engine = Engine(WorkerConfig(str(model), device="cuda", max_running=4))
    for text in ["Tell me about experts.", "Hi", "Ein längerer Satz über Mischungen von Experten " * 4]:
        messages = [{"role": "user", "content": text}]
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0)
        prompt = engine.tokenizer.apply_chat_template(messages, tokenize=True)
        (ref,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))
        assert reply.choices[0].message.content == engine.tokenizer.decode(ref.token_ids)
    prompt = [5, 17, 300, 42, 9, 77, 120, 3]  # three choices of one prefill: decode copies its state
    out = client.completions.create(
        model="m", prompt=prompt, max_tokens=12, n=3, temperature=1.0, seed=21, logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    got = [[int(t.removeprefix("token_id:")) for t in c.logprobs.tokens] for c in out.choices]
    params = [SamplingParams(temperature=1.0, seed=21 + i, max_tokens=12, ignore_eos=True) for i in range(3)]
    assert got == [r.token_ids for r in engine.generate([prompt] * 3, params)]
    assert server.stop() == 0


@pytest.mark.parametrize("encoder", ["cpu", "cuda"])
def test_images_on_cuda_answer_as_transformers(tmp_path, start_server, encoder):
    """A vision model on the GPU (decode's recorded steps rotate at position + delta), its encoder on the CPU
    or the GPU (its rows in host shared memory either way): a two-image chat answers what transformers
    answers, twice (the second reuses the rows the first gave back)."""
    from tests.services.test_serve_images import MAX_TOKENS, _chat, _data_url, _images, _reference

    model = make_model(tmp_path / "q4v", "tiny", "qwen4_exp", {"torch_dtype": "float32"})
    server = start_server(
        "--model", str(model), "--device", "cuda", "--dtype", "float32", "--encoder-device", encoder
    )
    images, texts = _images(), ["Compare", " with", " and say which is brighter."]
    prompt_len, want = _reference(model, images, texts, device="cuda")
    for _ in range(2):
        reply = server.client().chat.completions.create(
            model="q4v", messages=_chat(texts, [_data_url(i) for i in images]), max_tokens=MAX_TOKENS,
            temperature=0,
        )  # fmt: skip
        assert reply.usage.prompt_tokens == prompt_len and reply.choices[0].message.content == want
    assert server.stop() == 0


def test_the_readme_s_serve_on_cuda_is_bfloat16_through_a_cache(start_server):
    """`spillway serve --device cuda` with the embedded model and no other flag: decode holds bfloat16
    weights (serve's `auto` dtype on CUDA) and half the experts' slots (the embedded default's cache), as
    the offline engine with those settings does; a chat answers."""
    from tests.services.test_serve import _decode_metrics

    server = start_server("--device", "cuda")
    reply = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    engine = Engine(
        WorkerConfig(str(default_model_dir()), device="cuda", dtype="bfloat16", expert_cache="0.5")
    )
    text = _decode_metrics(server.port)
    for pool in ("weights", "expert_cache"):
        (held,) = re.findall(rf'^spillway:vram_bytes{{pool="{pool}"}} (\S+)$', text, re.M)
        assert float(held) == engine.pool_bytes()[pool], pool
    assert server.stop() == 0
