"""Optimizer, LR schedule and LR scaling with the batch size (docs/batch_size.md)."""
from __future__ import annotations

import math

import torch

from manual_train.config import Config


def scaled_lr(cfg: Config, global_batch_size: int) -> float:
    """--lr scaled from --base-batch-size to the global batch.

    linear: lr * B / B0 (Goyal et al. 2017, for SGD with warm-up); sqrt: lr * sqrt(B / B0) (the
    rule often used with Adam); none: --lr as given.
    """
    ratio = global_batch_size / cfg.base_batch_size
    if cfg.lr_scaling == "linear":
        return cfg.lr * ratio
    if cfg.lr_scaling == "sqrt":
        return cfg.lr * math.sqrt(ratio)
    return cfg.lr


def build_optimizer(cfg: Config, params, lr: float) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=cfg.weight_decay)


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, total_steps: int):
    """LambdaLR over optimizer steps: linear warm-up, then cosine decay to zero (or constant)."""
    warmup = cfg.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
