"""A loss of your own as a plug-in: `--loss manual_train.examples.focal_loss:focal_loss` (docs/your-model.md).

    python launch/single.py --loss manual_train.examples.focal_loss:focal_loss
    torchrun --nproc_per_node=2 launch/ddp.py --loss manual_train.examples.focal_loss:focal_loss --batch-size 16

Focal loss (Lin et al. 2017, "Focal Loss for Dense Object Detection"): cross-entropy times (1 - p)^gamma, where p
is the probability given to the right class, so examples the model already gets right weigh less.

The contract it meets: `loss(logits, y, reduction="mean")` like torch.nn.functional.cross_entropy's: logits
(B, C) or (B, L, C) against class ids y (B,) or (B, L), targets of -100 ignored; "mean" is the mean over the
targets, "sum" their sum. The loops weight each micro-batch's mean by its share of the window's targets and
evaluation sums with "sum", so the two must agree: sum == mean x the number of targets (checked at start).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

GAMMA = 2.0  # the paper's; 0 gives plain cross-entropy


def focal_loss(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    logits, y = logits.flatten(0, -2), y.flatten()
    keep = y != -100  # the positions without a target (padding of text)
    log_p = F.log_softmax(logits[keep], dim=-1).gather(-1, y[keep].unsqueeze(-1)).squeeze(-1)
    per_target = -((1 - log_p.exp()) ** GAMMA) * log_p
    return per_target.sum() if reduction == "sum" else per_target.mean()
