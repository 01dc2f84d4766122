"""The comparison every parity test makes: our logits against transformers', prefill then decode."""

from __future__ import annotations

import pytest
import torch


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def assert_matches_transformers(runner, hf, seqs, prompts, prefill, steps: int, tol: float) -> None:
    """`prefill` [T, V] (our logits of every prompt token, sequence by sequence) against `hf` run on each
    prompt alone, then `steps` decode steps of the whole batch, each fed the reference's argmax."""
    caches, next_tokens, offset = [], [], 0
    for prompt in prompts:
        out = hf(torch.tensor([prompt]), use_cache=True)
        ref = out.logits[0].float()  # [L, V]
        err = _rel_err(prefill[offset : offset + len(prompt)], ref)
        assert err < tol, f"prefill of {len(prompt)} tokens: relative error {err:.2e}"
        offset += len(prompt)
        caches.append(out.past_key_values)
        next_tokens.append(int(ref[-1].argmax()))
    for step in range(steps):
        ours = runner.forward(seqs, [[t] for t in next_tokens])  # [B, V]
        for b in range(len(prompts)):
            out = hf(torch.tensor([[next_tokens[b]]]), past_key_values=caches[b], use_cache=True)
            ref = out.logits[0, -1].float()
            err = _rel_err(ours[b], ref)
            assert err < tol, f"decode step {step}, sequence {b}: relative error {err:.2e}"
            caches[b] = out.past_key_values
            next_tokens[b] = int(ref.argmax())


@pytest.fixture
def matches_transformers():
    return assert_matches_transformers
