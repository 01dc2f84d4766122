"""Images end to end: `spillway serve` on a tiny qwen4_exp with a vision tower starts the encoder beside the
router, prefill and decode (separate processes over ZeroMQ; the embeddings handed to prefill through the
encoder's shared memory). A chat with two images, asked through the official `openai` client, answers what
transformers' Qwen4ExpForConditionalGeneration.generate answers for the same chat; a bad image is a 400; an
encoder killed is restarted and images are served again."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import openai
import pytest
import torch

from common.model.synthetic.checkpoint import make_model
from tests.conftest import Server, free_port, free_ports, health, wait_healthy

Image = pytest.importorskip("PIL.Image")
transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
hf_pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

pytestmark = pytest.mark.slow

SIZES = ((64, 96), (80, 48))  # (height, width)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = make_model(
        tmp_path_factory.mktemp("q4") / "tiny-q4v", "tiny", "qwen4_exp", {"torch_dtype": "float32"}
    )
    port, metrics = free_port(), free_ports(4)
    args = ["--model", str(model), "--port", str(port), "--threads", "1", "--dtype", "float32"]
    args += ["--expert-cache", "0.5", "--max-context", "1024", "--metrics-port", str(metrics)]
    server = Server(subprocess.Popen([sys.executable, "-m", "services.cli", "serve", *args]), port)
    try:
        wait_healthy(port)
        yield server, model, metrics + 3  # the encoder's metrics (one pair)
    finally:
        server.stop()


def _images() -> list:
    rng = np.random.default_rng(1)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _reference(model, images: list, texts: list[str], device: str = "cpu") -> tuple[int, str]:
    """transformers' prompt length and greedy answer for the chat [text, image, text, image, text], run on
    `device` (where fla-core is installed transformers calls its kernels, which take CUDA tensors only)."""
    tok = transformers.AutoTokenizer.from_pretrained(model)
    hf = (
        modeling.Qwen4ExpForConditionalGeneration.from_pretrained(
            model, dtype=torch.float32, attn_implementation="eager"
        )
        .to(device)
        .eval()
    )
    vision = hf.config.vision_config
    proc = hf_pil.Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size, min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
    )  # fmt: skip
    pixels = proc(images=images, return_tensors="pt")
    content = [{"type": "text", "text": texts[0]}]
    for image_text in texts[1:]:
        content += [{"type": "image"}, {"type": "text", "text": image_text}]
    text = tok.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    ids = tok.encode(text, add_special_tokens=False)
    counts = iter(int(g.prod()) // vision.spatial_merge_size**2 for g in pixels["image_grid_thw"])
    expanded = [t for i in ids for t in ([i] * next(counts) if i == hf.config.image_token_id else [i])]
    input_ids = torch.tensor([expanded], device=device)
    with torch.no_grad():
        out = hf.generate(
            input_ids=input_ids, pixel_values=pixels["pixel_values"].to(device),
            image_grid_thw=pixels["image_grid_thw"].to(device),
            mm_token_type_ids=(input_ids == hf.config.image_token_id).int(), max_new_tokens=MAX_TOKENS,
            do_sample=False,
        )  # fmt: skip
    return len(expanded), tok.decode(out[0, len(expanded) :], skip_special_tokens=True)


def _chat(texts: list[str], urls: list[str]) -> list[dict]:
    content = [{"type": "text", "text": texts[0]}]
    for url, text in zip(urls, texts[1:], strict=True):
        content += [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def test_a_chat_with_images_answers_as_transformers(stack) -> None:
    server, model, _ = stack
    client = server.client()
    images, texts = _images(), ["Compare", " with", " and say which is brighter."]
    messages = _chat(texts, [_data_url(i) for i in images])
    reply = client.chat.completions.create(
        model=model.name, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    prompt_len, want = _reference(model, images, texts)
    assert reply.usage.prompt_tokens == prompt_len
    assert reply.choices[0].message.content == want
    stream = client.chat.completions.create(
        model=model.name, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    assert health(server.port)[1]["services"]["encoder"]["state"] == "up"


def test_a_response_with_images_answers_as_the_chat(stack) -> None:
    """The Responses API's input_image parts reach the encoder as the chat's image_url parts do."""
    server, model, _ = stack
    client = server.client()
    images, texts = _images(), ["Compare", " with", " and say which is brighter."]
    urls = [_data_url(i) for i in images]
    chat = client.chat.completions.create(
        model=model.name, messages=_chat(texts, urls), max_tokens=MAX_TOKENS, temperature=0
    )
    content = [{"type": "input_text", "text": texts[0]}]
    for url, text in zip(urls, texts[1:], strict=True):
        content += [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": text}]
    response = client.responses.create(
        model=model.name,
        input=[{"role": "user", "content": content}],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_bad_images_are_400s(stack) -> None:
    server, model, _ = stack
    client = server.client()
    for url, says in (("data:image/png;base64,!!!", "base64"), ("https://example.com/a.png", "data URL")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=model.name, messages=_chat(["look", ""], [url]), max_tokens=2
            )
        assert says in err.value.message and err.value.param == "messages[0].content[1].image_url.url"
    not_png = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    with pytest.raises(openai.BadRequestError, match="cannot be read"):
        client.chat.completions.create(
            model=model.name, messages=_chat(["look", ""], [not_png]), max_tokens=2
        )


def test_a_killed_encoder_is_restarted_and_serves_again(stack) -> None:
    server, model, _ = stack
    client = server.client()
    pid = health(server.port)[1]["services"]["encoder"]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        encoder = health(server.port)[1].get("services", {}).get("encoder", {})
        if encoder.get("state") == "up" and encoder.get("pid") != pid:
            break
        time.sleep(0.3)
    else:
        raise AssertionError(f"the encoder did not come back: {encoder}")
    assert health(server.port)[1]["status"] == "ok"
    reply = client.chat.completions.create(
        model=model.name, messages=_chat(["look", " here"], [_data_url(_images()[0])]), max_tokens=4,
        temperature=0,
    )  # fmt: skip
    assert reply.usage.completion_tokens >= 1


def _gauge(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return float(re.search(rf"^spillway:{name} (\S+)$", text, re.M).group(1))


def _rows_lent(port: int) -> float:
    return _gauge(port, "encoder_rows_lent")


def test_requests_that_end_early_give_their_rows_back(stack) -> None:
    """A client that leaves after the first token, and many requests at once: the encoder's rows all come
    back (prefill takes them, or the abort frees them)."""
    server, model, encoder_metrics = stack
    client = server.client()
    messages = _chat(["look", " here"], [_data_url(_images()[1])])
    stream = client.chat.completions.create(model=model.name, messages=messages, max_tokens=50, stream=True)
    next(iter(stream))
    stream.close()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(
            lambda _: client.chat.completions.create(model=model.name, messages=messages, max_tokens=3),
            range(6),
        ))  # fmt: skip
    assert all(r.usage.completion_tokens >= 1 for r in replies)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the metrics follow the heartbeat
        encoded, lent = _gauge(encoder_metrics, "images_encoded_total"), _rows_lent(encoder_metrics)
        if encoded >= 7 and not lent:  # every request's image went through rows, and they came back
            break
        time.sleep(0.3)
    assert (encoded, lent) >= (7, 0) and lent == 0


def test_spillway_generate_with_images_answers_as_transformers(stack, tmp_path) -> None:
    """The offline path (`spillway generate --image`): the same prompt and answer as transformers."""
    _, model, _ = stack
    images = _images()
    paths = []
    for i, image in enumerate(images):
        paths += ["--image", str(tmp_path / f"{i}.png")]
        image.save(paths[-1])
    cli = [
        sys.executable,
        "-m",
        "services.cli",
        "generate",
        "--model",
        str(model),
        "--chat",
        "Describe them.",
    ]
    out = subprocess.run(
        [*cli, *paths, "--max-tokens", str(MAX_TOKENS), "--json"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    prompt_len, want = _reference(model, images, ["", "", "Describe them."])
    assert (len(got["prompt_ids"]), got["text"]) == (prompt_len, want)
    text_only = make_model(tmp_path / "text", "tiny", "qwen3_moe")
    refused = subprocess.run([*cli[:5], str(text_only), "--image", paths[1]], capture_output=True, text=True)
    assert refused.returncode == 2 and "vision tower" in refused.stderr


def test_images_past_the_pixel_budget_are_400s_at_once(stack) -> None:
    """Four PNG files of 13,000 x 13,000 pixels (a few hundred KB): refused from their headers, nothing
    decoded."""
    from tests.common.openai.test_image_budget import data_url, huge_png

    server, model, _ = stack
    url = data_url(huge_png(13_000, 13_000))
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError, match="pixels") as err:
        server.client().chat.completions.create(
            model=model.name, messages=_chat(["look", "", "", "", ""], [url] * 4), max_tokens=2
        )
    assert time.monotonic() - started < 2.0
    assert err.value.param == "messages[0].content[1].image_url.url"
