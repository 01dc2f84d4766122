"""serve-ipc: `spillway serve --device cuda` with prefill and decode as separate processes on one GPU. Shows
the device memory each process holds (decode owns weights and state pools; prefill maps them through CUDA IPC,
so it should hold only its CUDA context and activations) and checks greedy output against the single-process
engine on the same GPU.

    python -m bench.serve_ipc [--out DIR] [--expert-cache FRACTION]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import write_result
from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams

# ~2.6 GB of bf16 weights: big enough that a second copy would show
SHAPE = {"hidden_size": 2048, "moe_intermediate_size": 768, "num_hidden_layers": 8, "num_experts": 32}
PROMPTS = ["Tell me about experts.", "Hi", "Summarise the design of a disaggregated server."]


def _wait_healthy(port: int, timeout_s: float = 600) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                return json.loads(resp.read())
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not become healthy")


def _gpu_memory_by_pid() -> dict[int, int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line.split(",") for line in out.strip().splitlines() if line.strip()]
    return {int(pid): int(mib) for pid, mib in rows}


def _chat(port: int, text: str) -> str:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": text}]
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0)
    return reply.choices[0].message.content


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--expert-cache", default=None)
    parser.add_argument("--port", type=int, default=8321)
    args = parser.parse_args()
    model = make_model(Path(tempfile.mkdtemp()) / "m", preset="tiny", arch="qwen3_moe", overrides=SHAPE)
    argv = [sys.executable, "-m", "services.cli", "serve", "--model", str(model), "--device", "cuda"]
    argv += ["--dtype", "bfloat16", "--port", str(args.port), "--max-running", "4"]
    if args.expert_cache:
        argv += ["--expert-cache", args.expert_cache]
    server = subprocess.Popen(argv)
    try:
        health = _wait_healthy(args.port)
        served = [_chat(args.port, text) for text in PROMPTS]
        memory = _gpu_memory_by_pid()
        pids = {name: svc["pid"] for name, svc in health["services"].items()}
    finally:
        server.terminate()
        server.wait(timeout=60)
    engine = Engine(
        WorkerConfig(
            str(model), dtype="bfloat16", device="cuda", max_running=4, expert_cache=args.expert_cache
        )
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    offline = []
    for text in PROMPTS:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
        offline.append(engine.tokenizer.decode(engine.generate([prompt], greedy)[0].token_ids))
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    if args.expert_cache is None:
        weights += sum(w.gate_up.nbytes + w.down.nbytes for w in engine.model.experts.weights.values())
    result = {
        "device_mib_by_process": {name: memory.get(pid) for name, pid in pids.items()},
        "nvidia_smi_mib_by_pid": memory,
        "service_pids": pids,
        "resident_weight_mib": weights / 2**20,
        "expert_cache": args.expert_cache,
        "greedy_identical": served == offline,
        "served": served,
        "offline": offline,
    }
    path = write_result("serve-ipc" + ("-offloaded" if args.expert_cache else ""), result, args.out)
    print(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
