"""A tiny vision transformer as a plug-in model: `--model manual_train.examples.tiny_vit:build` (docs/your-model.md).

    python launch/single.py --model manual_train.examples.tiny_vit:build --optimizer adamw --lr 3e-3
    torchrun --nproc_per_node=2 launch/ddp.py --model manual_train.examples.tiny_vit:build --batch-size 16
    torchrun --nproc_per_node=2 launch/zero.py --stage 3 --model manual_train.examples.tiny_vit:build

Patches (4x4 where the sides allow, else 2x2 or single pixels) are embedded by one strided convolution, a learned
position embedding is added, pre-LayerNorm blocks (bidirectional attention, an MLP) follow, and the mean of the
patch tokens goes to a Linear head. On the 8x8 digits: 4 patches, 2 blocks of width 32, ~18k parameters.

The contract it meets: `build(info)` takes the data's DataInfo (input_shape C,H,W and num_classes) and returns an
nn.Module whose forward maps (B, C, H, W) to (B, num_classes) logits. Its blocks are an nn.ModuleList named
`blocks`: FSDP2 (launch/zero.py --stage 2/3) makes each block its own unit, gathered only while it runs.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):  # (B, T, C) -> (B, T, C); every patch attends to every patch
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyViT(nn.Module):
    def __init__(self, in_channels: int, height: int, width: int, num_classes: int, dim: int = 32, depth: int = 2,
                 heads: int = 2):
        super().__init__()
        patch = next(p for p in (4, 2, 1) if height % p == 0 and width % p == 0)
        self.patch_embed = nn.Conv2d(in_channels, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.randn(1, (height // patch) * (width // patch), dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))  # FSDP2's units (sharding.blocks)
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):  # (B, C, H, W) -> (B, num_classes)
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos  # (B, patches, dim)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x).mean(dim=1))


def build(info) -> nn.Module:
    """The plug-in entry point: a TinyViT for images of info.input_shape (C, H, W) and info.num_classes classes."""
    in_channels, height, width = info.input_shape
    return TinyViT(in_channels, height, width, info.num_classes)
