"""Sampling's extras on the GPU: logit biases, min_tokens and penalties (counted on the device) give what
they give on the CPU, with no host wait inside a step once the counts exist; a grammar's mask applies to
CUDA logits; the whole served path is tests/gpu/test_serve_cuda.py's."""

from __future__ import annotations

import pytest
import torch

from common.kv.state import SequenceState
from common.model.defaults import default_model_dir
from common.protocol import SamplingParams
from common.sampling.logit_processors import LogitProcessors
from common.sampling.requests import Request, sample_on_device
from common.text.tokenizer import Tokenizer

V, EOS = 1024, 2


def _requests() -> list[Request]:
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.6, frequency_penalty=0.7, presence_penalty=0.2),
        SamplingParams(temperature=0.9, seed=4, min_p=0.05, logit_bias=((17, 5.0), (EOS, -100.0))),
        SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=(9,)),
    ]
    return [
        Request([3, 4, 5, 4], p, p.seed or 0, SequenceState(slot), token_ids=[7, 7])
        for slot, p in zip((2, 0, 1), params, strict=True)
    ]


def _steps(device: str, steps: int = 6) -> list[list[int]]:
    torch.manual_seed(0)
    logits = [(torch.randn(3, V) * 4).to(device) for _ in range(steps)]
    procs = LogitProcessors(4, V, torch.device(device), [EOS])
    reqs = _requests()
    for r in reqs:
        procs.admit(r)
    out = []
    for step, row in enumerate(logits):
        watched = device == "cuda" and step > 0  # the counts exist: no host wait from here on
        if watched:
            torch.cuda.set_sync_debug_mode("error")
        try:
            tokens = sample_on_device(row, reqs, procs)
        finally:
            if watched:
                torch.cuda.set_sync_debug_mode("default")
        out.append(tokens.tolist())
        for r, t in zip(reqs, out[-1], strict=True):
            r.token_ids.append(t)
    return out


def test_processed_steps_on_cuda_sample_what_the_cpu_samples() -> None:
    assert _steps("cuda") == _steps("cpu")


def test_a_grammar_masks_cuda_logits() -> None:
    pytest.importorskip("xgrammar")
    from common.sampling.structured import structure_of

    tok = Tokenizer.from_dir(default_model_dir())
    fmt = {"type": "json_schema", "json_schema": {"schema": {"enum": ["yes", "no"]}}}
    procs = LogitProcessors(2, V, torch.device("cuda"), tok.eos_token_ids, tok)
    req = Request([1], SamplingParams(structure=structure_of(fmt)), 0, SequenceState(0))
    procs.admit(req)
    out = procs.apply(torch.zeros(1, V, device="cuda"), [req], [0])
    allowed = torch.isfinite(out[0]).nonzero().flatten().tolist()
    assert allowed and all(tok.token_bytes(t).startswith(b'"') for t in allowed)
