"""KV lending on the GPU, over the driver's virtual memory mappings: lent slots share no byte with the pages
in use, and an engine that lends (decode steps replayed from CUDA graphs) generates what one without does."""

from __future__ import annotations

import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams
from tests.common.experts.test_kv_lending import check_disjoint, run_lending
from tests.common.ipc.test_aliased import write_in_another_process

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_lent_slots_share_no_byte_with_the_pages_in_use_on_the_gpu() -> None:
    lending = check_disjoint("cuda", pages=8192, page_size=16)
    assert lending.memory.chunk >= 1 << 16  # the driver's granularity, not the host's page


def test_lending_on_the_gpu_generates_what_no_lending_does(tmp_path) -> None:
    """Eight lanes of 4,096 tokens (a 2 MiB chunk is 512 pages of this model's K or V): prompts of ~1,100
    tokens in all eight lanes pass two stages, so lent slots are reclaimed."""
    path = make_model(tmp_path, preset="tiny", arch="qwen3_moe", seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (1100, 1150, 1080, 1120) * 2]
    plain = Engine(WorkerConfig(str(path), device="cuda", max_running=8, max_context=4096))
    reference = [r.token_ids for r in plain.generate(prompts, GREEDY)]
    del plain
    out, engine = run_lending(path, prompts, "cuda", max_seqs=8, max_context=4096)
    assert out == reference
    assert engine.kv_lending.memory.total_bytes > 0


def test_an_exported_device_range_maps_the_same_bytes_in_another_process() -> None:
    """common.ipc.tensors on driver mappings: the child imports the range's allocations as POSIX descriptors
    from the fd server, maps them, and its writes land in this process's tensor and in the shared chunk."""
    import msgspec

    from common.ipc import tensors as ipc
    from common.ipc.aliased import AliasedMemory

    memory = AliasedMemory(2 * AliasedMemory.granularity("cuda"), "cuda")
    c = memory.chunk
    raw = memory.tensor(4 * c, [(2 * c, 2 * c, 0)])
    view = raw.view(torch.int32)[c // 4 :].view(-1, 16)[:, :8]
    wire = msgspec.json.encode(ipc.export_tensor(view))
    write_in_another_process(wire)
    want = torch.arange(view.numel(), dtype=torch.int32, device="cuda").view(view.shape)
    assert torch.equal(view, want)
    other = memory.tensor(2 * c, [(0, 2 * c, 0)])
    assert torch.equal(other.view(torch.int32), raw.view(torch.int32)[c // 2 :])
