"""Flat [T, ...] ⇄ padded [B, Lmax, ...] layouts of a ForwardBatch, for per-sequence recurrences."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.ipc.hostmem import host_list_to
from common.kv.batch import ForwardBatch


@dataclass
class Padding:
    """Where each token of a flat batch sits in the padded [B, Lmax] layout (sequences right-padded)."""

    seq: torch.Tensor  # [T] sequence of each token
    offset: torch.Tensor  # [T] index of each token within this pass of its sequence
    lens: torch.Tensor  # [B] tokens of each sequence in this pass
    max_len: int

    @classmethod
    def of(cls, batch: ForwardBatch) -> Padding:
        """The batch's padding, computed once per forward pass and shared by every layer."""
        return batch.per_pass("padding", lambda: cls._build(batch))

    @classmethod
    def _build(cls, batch: ForwardBatch) -> Padding:
        device = batch.input_ids.device
        if batch.is_decode:  # one token per sequence; built from no host list, so a graph can record it
            ones = torch.ones_like(batch.seq_index)
            return cls(batch.seq_index, torch.zeros_like(batch.seq_index), ones, 1)
        lens = host_list_to(batch.query_lens, device)
        starts = lens.cumsum(0) - lens
        offset = torch.arange(batch.input_ids.shape[0], device=device) - starts[batch.seq_index]
        return cls(batch.seq_index, offset, lens, max(batch.query_lens))

    def pad(self, x: torch.Tensor, value: float = 0.0) -> torch.Tensor:
        """x [T, ...] → [B, Lmax, ...], `value` in the padding."""
        out = x.new_full((self.lens.shape[0], self.max_len, *x.shape[1:]), value)
        out[self.seq, self.offset] = x
        return out

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Lmax, ...] → [T, ...]."""
        return x[self.seq, self.offset]


def causal_conv(
    x: torch.Tensor,
    history: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    pad: Padding,
    dilation: int = 1,
) -> torch.Tensor:
    """Depthwise causal conv of x [T, C] continuing each sequence's history; updates the history in place.

    history [S, C, W] holds the last W = (K - 1) · dilation inputs of each slot (zeros for a new sequence);
    weight [C, K]. Returns the conv output [T, C] (no activation) in x's dtype.
    """
    width = history.shape[-1]
    hist = history[slots].to(x.dtype)  # [B, C, W]
    padded = torch.cat([hist, pad.pad(x).transpose(1, 2)], dim=-1)  # [B, C, W + Lmax]
    out = torch.nn.functional.conv1d(padded, weight[:, None, :], groups=x.shape[1], dilation=dilation)
    # New history: the W inputs ending at each sequence's last token.
    idx = pad.lens[:, None] + torch.arange(width, device=x.device)[None, :]  # [B, W]
    history[slots] = padded.gather(2, idx[:, None, :].expand(-1, x.shape[1], -1)).to(history.dtype)
    return pad.unpad(out.transpose(1, 2))  # [T, C]
