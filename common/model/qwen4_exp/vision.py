"""qwen4_exp's vision tower (a Qwen3-VL-style ViT): image patches → embeddings in the text model's width.

The math and parameter names of transformers' `Qwen4ExpVisionModel` (its checkpoint keys under
`model.visual.`), in plain PyTorch: a Conv3d patch embedding, a learned square position table resampled
(bilinear, corners aligned) to each image's patch grid, `depth` pre-norm blocks of bidirectional attention
within each image (axial 2D rotary positions on the whole head) and a GELU MLP, then a merger that joins
each `m × m` block of patches (m = spatial_merge_size) into one token.

Patches arrive as the Qwen2-VL image processor lays them out: one row per patch of
`in_channels × temporal_patch_size × patch_size²` values, each image's patches in merge-block order
(block row, block column, row within the block, column within it), images one after another.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.model.checkpoint import check_shape, check_weight, safetensors_source
from common.model.errors import CheckpointError

PREFIX = "model.visual."
"""Where a qwen4_exp checkpoint keeps the vision tower's tensors."""


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's shape (config.json's `vision_config`)."""

    depth: int
    """Transformer blocks."""
    hidden_size: int
    """Width of the tower."""
    intermediate_size: int
    """Width of each block's MLP."""
    num_heads: int
    """Attention heads (head_dim = hidden_size / num_heads)."""
    out_hidden_size: int
    """Width of a merged token: the text model's hidden size."""
    in_channels: int = 3
    patch_size: int = 16
    """Pixels along a patch's side."""
    temporal_patch_size: int = 2
    """Frames a patch spans (an image is repeated to fill them)."""
    spatial_merge_size: int = 2
    """Patches along a side of the block the merger joins into one token."""
    num_position_embeddings: int = 2304
    """Entries of the learned position table (a square: 48 × 48)."""
    rope_theta: float = 10000.0
    hidden_act: str = "gelu_pytorch_tanh"

    @classmethod
    def from_hf(cls, vision: dict[str, Any]) -> VisionConfig:
        """From config.json's `vision_config` section."""
        rope = vision.get("rope_parameters") or {}
        fields = {k: vision[k] for k in cls.__dataclass_fields__ if k in vision and k != "rope_theta"}
        return cls(**fields, rope_theta=float(rope.get("rope_theta", 10000.0)))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def _activation(name: str):
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"vision_config.hidden_act {name!r} is not supported (gelu_pytorch_tanh, gelu)")


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        x = patches.view(-1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, c.hidden_size)  # [N, D]


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)  # [N, H, d] each
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = []
        for qi, ki, vi in zip(*(t.split(lengths) for t in (q, k, v)), strict=True):  # each image alone
            o = F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1))
            out.append(o.transpose(0, 1).reshape(len(qi), -1))  # [n_i, H*d]
        return self.proj(torch.cat(out))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions in fp32 on the whole head: x [N, H, d], cos/sin [N, d]."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class Mlp(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = _activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = Attention(cfg)
        self.mlp = Mlp(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """Each m × m block of patches (consecutive in merge-block order) → one token of the text's width."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.width)  # [N / m², m² D]
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """Patches [N, C·T·P²] of images whose patch grids are `grid_thw` [n, 3] → tokens [N / m², out]."""

    inv_freq: torch.Tensor
    """[head_dim / 4] the rotary inverse frequencies of each axis (a buffer)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.side = int(cfg.num_position_embeddings**0.5)
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.merger = Merger(cfg)
        d = cfg.head_dim // 2  # each axis rotates half the head
        self.register_buffer(
            "inv_freq",
            1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d),
            persistent=False,
        )

    def forward(self, patches: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        m = self.cfg.spatial_merge_size
        for _, h, w in grid_thw:
            if h % m or w % m:
                raise ValueError(f"an image's patch grid {h} x {w} is not a multiple of the merge size {m}")
        x = self.patch_embed(patches)  # [N, D]
        x = x + torch.cat([self._positions(t, h, w) for t, h, w in grid_thw]).to(x.dtype)
        cos, sin = self._rotary(grid_thw)  # [N, d] each
        lengths = [h * w for t, h, w in grid_thw for _ in range(t)]  # attention within each frame
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)

    def _merge_order(self, grid: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[h, w, ...] in raster order → [h·w, ...] in merge-block order."""
        m = self.cfg.spatial_merge_size
        blocks = grid.reshape(h // m, m, w // m, m, *grid.shape[2:]).transpose(1, 2)
        return blocks.reshape(h * w, *grid.shape[2:])

    def _positions(self, t: int, h: int, w: int) -> torch.Tensor:
        """The learned position table resampled to an h × w grid, each frame alike: [t·h·w, D]."""
        table = self.pos_embed.weight.view(self.side, self.side, -1).permute(2, 0, 1)[None]  # [1, D, s, s]
        grid = F.interpolate(table.float(), size=(h, w), mode="bilinear", align_corners=True)[0]
        return self._merge_order(grid.permute(1, 2, 0), h, w).repeat(t, 1)

    def _rotary(self, grid_thw: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's (row, column) angles, half of the head each, then repeated: cos, sin [N, d]."""
        rows, cols = [], []
        for t, h, w in grid_thw:
            r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            rows.append(self._merge_order(r, h, w).repeat(t))
            cols.append(self._merge_order(c, h, w).repeat(t))
        device = self.inv_freq.device
        halves = [torch.cat(p).to(device)[:, None].float() * self.inv_freq for p in (rows, cols)]
        angles = torch.cat(halves, dim=-1)  # [N, d / 2]
        angles = torch.cat((angles, angles), dim=-1)  # [N, d]
        return angles.cos(), angles.sin()


def load_vision_tower(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> VisionTower:
    """The vision tower of a qwen4_exp checkpoint (config.json's `vision_config`, the `model.visual.`
    tensors); CheckpointError naming the file and key of a tensor missing, misshaped or not a weight."""
    config_path = Path(model_dir) / "config.json"
    vision = json.loads(config_path.read_text()).get("vision_config")
    if not vision:
        raise CheckpointError("the model has no vision_config: it takes no images", config_path)
    tower = VisionTower(VisionConfig.from_hf(vision)).to(dtype)
    wanted = tower.state_dict()
    loaded: dict[str, torch.Tensor] = {}
    for path, key, read in safetensors_source(model_dir):
        name = key.removeprefix(PREFIX)
        if key.startswith(PREFIX) and name in wanted:
            tensor = read()
            check_weight(tensor, path, key)
            check_shape(tensor, tuple(wanted[name].shape), path, key)
            loaded[name] = tensor.to(dtype)
    missing = sorted(set(wanted) - set(loaded))
    if missing:
        raise CheckpointError(
            f"the vision tower's tensor is missing ({len(missing)} missing)", model_dir, PREFIX + missing[0]
        )
    tower.load_state_dict(loaded, strict=True)
    return tower.to(device).eval()
